# torch.func by example: the front door. `make help` lists the targets.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# What the site targets need first. The tests set it empty, to build a copy of the sources
# with the interpreter they already run in.
NEEDS   ?= $(STAMP)
BUILD   := _build
# Build one example while writing it: make html EXAMPLE=plot_per_sample_grads
EXAMPLE ?=
SPHINXOPTS ?=
LINTED  := examples tests docs conf.py
# -W: a warning fails the build; --keep-going: but report every warning first.
SPHINXBUILD = $(PY) -m sphinx -b html -W --keep-going -c . $(SPHINXOPTS) docs $(BUILD)/html

.DEFAULT_GOAL := help
.PHONY: help venv html html-noplot test lint serve clean

help:  ## List the targets
	@echo "torch.func by example. Targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14 | sed 's/^/  make /'
	@echo "Variables: EXAMPLE=plot_name (build and run one example), PYTHON=python3.11"

venv: $(STAMP)  ## Create .venv from requirements.txt (again when requirements.txt changes)

$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "error: $(PYTHON) is older than Python 3.11; run: make PYTHON=python3.11 ..." >&2; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

# A failed build forgets Sphinx's saved environment, so that the next build reads every page
# again and reports the same problems, instead of quietly reusing a half-built site.
FORGET_ON_FAILURE = || { rm -rf $(BUILD)/html/.doctrees; echo "error: the site did not build; see the messages above" >&2; exit 1; }

html: $(NEEDS)  ## Build the site, running the examples, into _build/html
	GALLERY_EXAMPLE="$(EXAMPLE)" $(SPHINXBUILD) $(FORGET_ON_FAILURE)
	@echo "Built the site: open $(CURDIR)/$(BUILD)/html/index.html"

html-noplot: $(NEEDS)  ## Build the site without running the examples
	$(SPHINXBUILD) -D plot_gallery=0 $(FORGET_ON_FAILURE)
	@echo "Built the site (examples not run): open $(CURDIR)/$(BUILD)/html/index.html"

test: $(STAMP)  ## Run the test suite (it builds its own copy of the site)
	$(PY) -m pytest tests

lint: $(NEEDS)  ## Check the code style of examples, tests and docs with ruff
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)

serve: ## Serve the built site on http://127.0.0.1:8000
	$(PY) -m http.server --bind 127.0.0.1 --directory $(BUILD)/html 8000

clean:  ## Remove the built site and the generated gallery (keeps .venv)
	rm -rf $(BUILD) docs/auto_examples docs/sg_execution_times.rst
