# torch.func by example: the front door. `make help` lists the targets.

# Recipes run in bash with pipefail: a build piped into its log still fails when the build does.
SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# What the site targets need first. The tests set it empty, to build a copy of the sources
# with the interpreter they already run in.
NEEDS   ?= $(STAMP) usable-venv
# Where pip may also look for torch. Empty: the package index alone, whose Linux x86_64 wheel of
# torch is the CUDA build (several GB of CUDA libraries, used or not). PyTorch's own index of CPU
# builds, TORCH_INDEX=https://download.pytorch.org/whl/cpu, gives the small CPU build instead.
TORCH_INDEX ?=
BUILD   := _build
# Build one example while writing it: make html EXAMPLE=plot_per_sample_grads
EXAMPLE ?=
# Build one shard of the gallery: make html SHARD=2/3 runs only the examples of shard 2 of 3,
# balanced by the recorded run times (docs/measured/example-times.txt); `make shards` shows them.
SHARD   ?=
SHARDS  ?= 3
# make merge FROM=folder: one folder per shard, each a copy of a shard's docs/auto_examples.
FROM    ?=
# Every example, by name: the gallery's sections are the folders of examples/.
EXAMPLES := $(sort $(basename $(notdir $(wildcard examples/*/plot_*.py))))
SPHINXOPTS ?=
LINTED  := examples tests docs tools conf.py
# Spelling (codespell) of what readers read; reST markup (sphinx-lint) of the hand-written pages.
SPELLED := examples docs README.md
NOT_SPELLED := docs/auto_examples,docs/gen_modules,docs/_inventories,docs/sg_execution_times.rst
# Names codespell takes for typos: Bu (Bu et al., 2023, on the DP-SGD page); donot (torch.cdist's
# compute_mode "donot_use_mm_for_euclid_dist", on troubleshooting part 7).
NOT_TYPOS := bu,donot
MARKUP  := $(filter-out docs/sg_execution_times.rst,$(wildcard docs/*.rst)) $(wildcard examples/README.rst examples/*/README.rst)
# make reproduce: fresh runs per example, and where the full report goes (the timings page shows it)
RUNS    ?= 5
REPORT  ?= docs/measured/reproduce-report.txt
# The browser the tests drive: the system's Chromium, or CHROMIUM=/path/to/chrome.
CHROMIUM ?= chromium
# -W: a warning fails the build; --keep-going: but report every warning first. -E: read every
# page afresh, so a build never reuses state from an earlier, failed one (examples that ran
# successfully are still skipped by their MD5).
SPHINXBUILD = $(PY) -m sphinx -b html -E -W --keep-going -c . $(SPHINXOPTS) docs $(BUILD)/html
FAILED  = { echo "error: the site did not build; see the messages above" >&2; exit 1; }
# Everything Sphinx prints also goes to $(BUILD)/sphinx.log, which the tests of a built site read.
LOG     = $(SPHINXBUILD) 2>&1 | tee $(BUILD)/sphinx.log
OPEN    = open $(CURDIR)/$(BUILD)/html/index.html

.DEFAULT_GOAL := help
.PHONY: help venv usable-venv known-example known-shard html html-noplot merge shards record-times test \
	test-shard test-merged browser lint reproduce inventory serve clean

help:  ## List the targets
	@echo "torch.func by example. Targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14 | sed 's/^/  make /'
	@echo "Variables: EXAMPLE=plot_name (one example, for html and reproduce), RUNS=5 (reproduce),"
	@echo "           SHARD=i/N (html: one shard of N), SHARDS=3 (shards, test-merged), FROM=folder (merge),"
	@echo "           PYTHON=python3.11 (to create .venv), CHROMIUM=/path/to/chrome (tests),"
	@echo "           TORCH_INDEX=https://download.pytorch.org/whl/cpu (.venv with torch's CPU build)"

venv: $(STAMP)  ## Create .venv from requirements.txt (again when requirements.txt changes)

$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || \
	  { echo "error: '$(PYTHON)' is not Python 3.11 or newer; run: make PYTHON=python3.11 ..." >&2; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements.txt
	touch $@

usable-venv:
	@$(PY) -c 'import sphinx, torch' 2>/dev/null || \
	  { echo "error: $(VENV) is stale or broken ($(PY) cannot import sphinx and torch); remove it (rm -rf $(VENV)) and run make again" >&2; exit 1; }

# SHARD=i/N: checked before the build by the code that picks the shard, in one line of error.
known-shard: $(NEEDS)
	@[ -z "$(SHARD)" ] || $(PY) docs/sphinxext/gallery_shards.py --check "$(SHARD)" "$(EXAMPLE)"

known-example:
	@if [ -n "$(EXAMPLE)" ] && [ -z "$(filter $(basename $(EXAMPLE)),$(EXAMPLES))" ]; then \
	  echo "error: no example called '$(EXAMPLE)'. The examples are: $(EXAMPLES)" >&2; exit 1; fi

html: known-example $(NEEDS) known-shard  ## Build the site, running the examples (SHARD=i/N: one shard's), into _build/html
	@mkdir -p $(BUILD)
	GALLERY_EXAMPLE="$(basename $(EXAMPLE))" GALLERY_SHARD="$(SHARD)" $(LOG) || $(FAILED)
	@echo "Built the site: $(OPEN)" | tee -a $(BUILD)/sphinx.log

html-noplot: $(NEEDS)  ## Build the site without running the examples
	$(SPHINXBUILD) -D plot_gallery=0 || $(FAILED)
	@echo "Built the site (examples not run): $(OPEN)"

merge: $(NEEDS)  ## Build the site from shards' outputs (FROM=folder), running no example
	@[ -n "$(FROM)" ] || { echo "error: say where the shards' outputs are: make merge FROM=folder, one folder per shard, each a copy of a shard's docs/auto_examples" >&2; exit 1; }
	$(PY) tools/merge_shards.py "$(FROM)"
	@mkdir -p $(BUILD)
	GALLERY_MERGE=1 $(LOG) || $(FAILED)
	@echo "Built the site from the shards, running no example: $(OPEN)" | tee -a $(BUILD)/sphinx.log

shards: $(NEEDS)  ## Show how SHARDS=3 shards split the examples by their recorded times
	$(PY) docs/sphinxext/gallery_shards.py $(SHARDS)

record-times: $(NEEDS)  ## After a full make html: record each example's run time for the shards
	$(PY) tools/record_times.py

browser:
	@command -v "$(CHROMIUM)" >/dev/null || \
	  { echo "error: no browser '$(CHROMIUM)' for the browser tests: apt-get install chromium, or set CHROMIUM=/path/to/chrome" >&2; exit 1; }

test: browser $(NEEDS)  ## Run the test suite (it builds its own copy of the site)
	CHROMIUM="$$(command -v "$(CHROMIUM)")" $(PY) -m pytest tests

test-shard: $(NEEDS) known-shard  ## After make html SHARD=i/N: run that shard's notebooks in a kernel
	@[ -n "$(SHARD)" ] || { echo "error: say which shard's notebooks to run: make test-shard SHARD=i/N" >&2; exit 1; }
	SITE_TREE=$(CURDIR) GALLERY_SHARD="$(SHARD)" $(PY) -m pytest tests/test_downloading.py -k test_notebook_runs

test-merged: browser $(NEEDS)  ## After make merge: every test but the notebooks (test-shard runs them), on this site
	SITE_TREE=$(CURDIR) NOTEBOOK_SHARDS=$(SHARDS) CHROMIUM="$$(command -v "$(CHROMIUM)")" \
	  $(PY) -m pytest tests -k "not test_notebook_runs"

lint: $(NEEDS)  ## Code style (ruff), spelling (codespell) and reST markup (sphinx-lint)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m codespell_lib --skip '$(NOT_SPELLED)' --ignore-words-list $(NOT_TYPOS) $(SPELLED)
	$(PY) -m sphinxlint $(MARKUP)

reproduce: known-example $(NEEDS)  ## Run each built example's download RUNS times afresh; compare its ratios with the page
	$(PY) tools/reproduce.py --runs $(RUNS) $(if $(EXAMPLE),--example $(basename $(EXAMPLE)),--report $(REPORT))

inventory: $(NEEDS)  ## Rewrite docs/_inventories/torch.inv from the installed torch (after a torch upgrade)
	$(PY) tools/torch_inventory.py

serve: ## Serve the built site on http://127.0.0.1:8000
	@[ -f $(BUILD)/html/index.html ] || { echo "error: nothing to serve in $(BUILD)/html: run make html first" >&2; exit 1; }
	$(PY) -m http.server --bind 127.0.0.1 --directory $(BUILD)/html 8000

clean:  ## Remove the built site and the generated gallery (keeps .venv)
	rm -rf $(BUILD) docs/auto_examples docs/gen_modules docs/sg_execution_times.rst
