# Quick start: `make demo` (set up, train on the bundled corpus, report) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-hf-oldest lint bench clean

install: $(VENV)/.installed

# constraints.txt pins what this repository's own installs use (torch 2.13.0, the version the
# suite runs with); the package itself accepts any torch of the range in pyproject.toml.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $@

demo: install
	$(BIN)/adaspan demo

test: install
	$(BIN)/python -m pytest -n 2 tests

# the Hugging Face tests on the oldest transformers adaspan.hf supports, laid over the
# environment's own (its dependencies as that version asks)
HF_OLDEST := transformers==5.17.0
test-hf-oldest: install
	$(BIN)/pip install --quiet --disable-pip-version-check --target .hf-oldest --no-deps \
		$(HF_OLDEST) "huggingface-hub>=1.5,<2"
	$(BIN)/pip install --quiet --disable-pip-version-check --target .hf-oldest httpx
	PYTHONPATH=.hf-oldest $(BIN)/python -m pytest -n 2 tests/hf

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache .hf-oldest
