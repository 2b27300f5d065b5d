// Scatter-gather copy for the shm transport: one call copies a whole list of runs.
//
//   int64_t pdserve_copy_runs(runs, num_runs, src_bases, src_lengths, num_src,
//                             dst_bases, dst_lengths, num_dst)
//
// runs:                   int64 [num_runs, 5] of (src region, src offset, dst region, dst offset,
//                         length), the columns of kv_transfer.transfer_plan.TransferPlan.runs.
// src_bases, src_lengths: int64 [num_src], address in this process and bytes of each source
//                         region; dst_bases, dst_lengths the same for the destination regions.
//
// Returns -1 once every byte is in place, else the index of the first run that is empty or lies
// outside its regions (or names a region that does not exist); then nothing was copied. Every run
// is checked before the first byte moves, so a bad list is an error, never a stray write.
//
// Runs are copied in list order, so runs whose destinations overlap end as if copied one after
// another (the later wins). Where a source region's addresses overlap a destination region's,
// each run is a memmove. Otherwise runs that follow on in both source and destination are merged
// first, and a run of at least kStreamMin bytes is written with non-temporal (streaming) stores:
// a KV page is written once here and read next by the decode process, so pulling the destination
// lines into this core's cache first (read-for-ownership) would cost a third pass over DRAM for
// nothing. A store fence ends the call, so every byte is visible to other processes before the
// caller releases the transfer's slot mutex (the shm fence, design.md).
//
// Plain C ABI (no torch headers), built by torch.utils.cpp_extension like the attention kernel
// and called through ctypes, which releases the GIL for the call.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

// Below this a run is copied with memcpy: streaming stores pay off only over whole lines, and
// small runs are likely read back soon from the cache.
constexpr int64_t kStreamMin = 4096;

bool in_bounds(int64_t region, int64_t offset, int64_t length, const int64_t* lengths,
               int64_t num_regions) {
  return region >= 0 && region < num_regions && offset >= 0 && length > 0 &&
         offset <= lengths[region] - length;
}

bool regions_overlap(const int64_t* a_bases, const int64_t* a_lengths, int64_t num_a,
                     const int64_t* b_bases, const int64_t* b_lengths, int64_t num_b) {
  for (int64_t i = 0; i < num_a; ++i) {
    for (int64_t j = 0; j < num_b; ++j) {
      const uint64_t a = static_cast<uint64_t>(a_bases[i]);
      const uint64_t b = static_cast<uint64_t>(b_bases[j]);
      if (a < b + static_cast<uint64_t>(b_lengths[j]) &&
          b < a + static_cast<uint64_t>(a_lengths[i])) {
        return true;
      }
    }
  }
  return false;
}

// Copies `length` bytes, the destination's whole 64-byte lines with streaming stores, and
// prefetches the next run's source line by line meanwhile: runs are scattered, and the hardware
// prefetcher stops at each 4 KiB page, so each run would otherwise start with serial misses.
void stream_copy(char* dst, const char* src, int64_t length, const char* next_src,
                 int64_t next_length) {
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
  const int64_t head = static_cast<int64_t>((64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
  std::memcpy(dst, src, static_cast<size_t>(head));
  dst += head;
  src += head;
  length -= head;
  const int64_t body = length & ~static_cast<int64_t>(63);
  for (int64_t at = 0; at < body; at += 64) {
    if (at < next_length) {
      __builtin_prefetch(next_src + at);
    }
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + at),
                        _mm512_loadu_si512(reinterpret_cast<const void*>(src + at)));
#elif defined(__AVX2__)
    for (int k = 0; k < 64; k += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + at + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + at + k)));
    }
#else
    for (int k = 0; k < 64; k += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + k)));
    }
#endif
  }
  std::memcpy(dst + body, src + body, static_cast<size_t>(length - body));
#else
  (void)next_src;
  (void)next_length;
  std::memcpy(dst, src, static_cast<size_t>(length));  // no streaming stores on this target
#endif
}

}  // namespace

extern "C" int64_t pdserve_copy_runs(const int64_t* runs, int64_t num_runs,
                                     const int64_t* src_bases, const int64_t* src_lengths,
                                     int64_t num_src, const int64_t* dst_bases,
                                     const int64_t* dst_lengths, int64_t num_dst) {
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t* run = runs + 5 * i;
    if (!in_bounds(run[0], run[1], run[4], src_lengths, num_src) ||
        !in_bounds(run[2], run[3], run[4], dst_lengths, num_dst)) {
      return i;
    }
  }
  const bool aliased =
      regions_overlap(src_bases, src_lengths, num_src, dst_bases, dst_lengths, num_dst);
  bool streamed = false;
  int64_t i = 0;
  while (i < num_runs) {
    const int64_t* run = runs + 5 * i;
    const char* src = reinterpret_cast<const char*>(src_bases[run[0]] + run[1]);
    char* dst = reinterpret_cast<char*>(dst_bases[run[2]] + run[3]);
    int64_t length = run[4];
    ++i;
    if (aliased) {
      std::memmove(dst, src, static_cast<size_t>(length));
      continue;
    }
    // Merge the runs that follow on in both source and destination into one copy.
    for (; i < num_runs; ++i) {
      const int64_t* next = runs + 5 * i;
      if (reinterpret_cast<const char*>(src_bases[next[0]] + next[1]) != src + length ||
          reinterpret_cast<char*>(dst_bases[next[2]] + next[3]) != dst + length) {
        break;
      }
      length += next[4];
    }
    const char* next_src = nullptr;
    int64_t next_length = 0;
    if (i < num_runs) {
      const int64_t* next = runs + 5 * i;
      next_src = reinterpret_cast<const char*>(src_bases[next[0]] + next[1]);
      next_length = next[4];
    }
    if (length >= kStreamMin) {
      stream_copy(dst, src, length, next_src, next_length);
      streamed = true;
    } else {
      std::memcpy(dst, src, static_cast<size_t>(length));
    }
  }
#if defined(__SSE2__)
  if (streamed) {
    _mm_sfence();  // streaming stores are weakly ordered: all visible before the caller unlocks
  }
#endif
  (void)streamed;
  return -1;
}
