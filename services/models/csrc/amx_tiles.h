// The tile palette of pdserve's AMX kernels (amx_linear_amx.cpp, the amx variant of
// prefill_attention_kernel.h): eight tiles of 16 rows x 64 bytes, which is every tile they use
// (16 x 32 bf16, 16 x 16 fp32, 16 x 16 bf16 pairs). Include after switching the target to AMX;
// like simd.h it sits in an anonymous namespace, one copy per kernel file.
#pragma once

#include <stdint.h>
#include <string.h>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

inline TileConfig make_tile_config() {
  TileConfig config;
  memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = 16;
    config.bytes_per_row[tile] = 64;
  }
  return config;
}

// Loads the palette on the calling thread (tile state is per thread) for the kernel's lifetime
// on it; the destructor releases it, so the thread's next context switch saves no tile data.
class TileScope {
 public:
  TileScope() {
    static const TileConfig config = make_tile_config();
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace
