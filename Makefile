# Every target installs what it needs into .venv first (Python >= 3.11).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?= Explain speculative decoding in two sentences.
ARGS   ?=

.PHONY: run run-ops test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# torch is pinned first so pip takes the local CPU build instead of a multi-GB CUDA one.
$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,oracle,plot]'
	touch $@

# auto speculation, with the plain loop on the same prompt measured beside it in the same process
run: $(VENV)/.base  ## generate with the embedded default model (fetched on first use)
	$(VENV)/bin/specjax generate --model smollm2-135m --chat --method auto --prompt "$(PROMPT)" $(ARGS)

# the ops prompts (configuration and diagnostic) through the scheduler, auto against plain per class
run-ops: $(VENV)/.base
	$(VENV)/bin/specjax generate --model smollm2-135m --chat --method auto --max-new-tokens 256 \
	    --prompts-file ../shared/data/ops-dev.jsonl --per-task 4 $(ARGS)

test: $(VENV)/.test  ## the whole suite, the real-model oracle tests included
	$(PY) -m pytest -q --durations=25 -rs $(ARGS)

bench: $(VENV)/.test
	$(VENV)/bin/specjax bench $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
