PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/attnlab demo

bench: $(STAMP)
	$(BIN)/attnlab bench attention
	$(BIN)/attnlab bench mha
	$(BIN)/attnlab bench generate
	$(BIN)/attnlab bench variants --max-len 32768 --repeats 3
	$(BIN)/attnlab bench qwen2
	$(BIN)/attnlab bench families

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) build src/*.egg-info
