PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Reinstalled only when pyproject.toml changes.
STAMP := $(VENV)/.installed
MODEL_DIR := models/tiny-llama
PROTO_FILES := $(shell find protos -name '*.proto' 2>/dev/null)

.PHONY: setup protos test lint format model run bench clean

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

# pytest exits 5 when it collected nothing; a test run that ran no test is a failure.
test: setup protos
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; \
	exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

model: setup $(MODEL_DIR)/config.json

# Built aside and moved into place, so an interrupted build never looks finished.
$(MODEL_DIR)/config.json:
	rm -rf $(MODEL_DIR).tmp
	$(PY) -m services.models.tiny $(MODEL_DIR).tmp --arch llama --size tiny
	rm -rf $(MODEL_DIR) && mv $(MODEL_DIR).tmp $(MODEL_DIR)

run: model
	@echo "Built the tiny model in $(MODEL_DIR)."
	@echo "The serving stack (prefill/decode nodes, gateway) is not available yet;"
	@echo "it arrives with the gateway and service issues. Run 'make test' to exercise the engine."

bench: setup
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf .pytest_cache .ruff_cache .mypy_cache *.egg-info models benchmarks/results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o \( -name '*_pb2.py' -o -name '*_pb2_grpc.py' \
		-o -name '*_pb2.pyi' \) -type f -exec rm -f {} +
