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
# environment's own: with the huggingface-hub and tokenizers that version asks (it checks them
# at import), and the datasets (and its httpx) of that hub for lm-eval
HF_OLDEST := transformers==4.56.2 "huggingface-hub>=0.34,<1" "tokenizers>=0.22,<=0.23.0" \
	"datasets<5"
test-hf-oldest: install
	rm -rf .hf-oldest
	$(BIN)/pip install --quiet --disable-pip-version-check --target .hf-oldest --no-deps \
		$(HF_OLDEST)
	$(BIN)/pip install --quiet --disable-pip-version-check --target .hf-oldest "httpx<1"
	PYTHONPATH=.hf-oldest $(BIN)/python -m pytest -n 2 tests/hf

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache .hf-oldest
