# Every target installs what it needs into .venv first (Python >= 3.11).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?=
ARGS   ?=
PORT   ?= 8000
# pytest-xdist workers for `make test`: one per core; WORKERS=0 runs the suite in one process
WORKERS ?= auto

.PHONY: run run-ops serve test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	-$(PY) -W ignore::RuntimeWarning -m specjax.models.linear  # builds the CPU verify kernel now (XLA's dot is used without it)
	-$(PY) -W ignore::RuntimeWarning -m specjax.models.cpu_attention  # and the CPU attention kernel (else XLA's attention)
	touch $@

# torch is pinned first so pip takes the local CPU build instead of a multi-GB CUDA one.
$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,oracle,plot]'
	touch $@

# auto speculation against plain decoding on the same prompts, 3 runs each in turns: the speedup with
# its spread; without PROMPT, the shipped demo set (specjax/bench/data/demo.jsonl): a configuration
# edit with the file as its prediction (where prediction and prompt lookup pay), a configuration request
# under a JSON schema (where forced text pays) and an open question (where auto falls back). It says so
# when a speedup comes from the output repeating itself. Auto chooses among prompt lookup, the prediction
# and the forced text at their lengths here: every option it may choose is compiled before the first
# token, so the first run waits for each (`--method auto` without --auto-methods adds the shipped Medusa
# and EAGLE heads). A --method in ARGS replaces auto.
run: $(VENV)/.base  ## generate with the embedded default model (fetched on first use)
	$(VENV)/bin/specjax generate --model smollm2-135m --chat \
	    $(if $(findstring --method,$(ARGS)),,--method auto --auto-methods ngram,predict,forced) \
	    $(if $(PROMPT),--prompt "$(PROMPT)",--demo) $(ARGS)

# the shipped ops prompts (configuration files and diagnostic questions) through the scheduler, auto
# against plain per class
run-ops: $(VENV)/.base
	$(VENV)/bin/specjax generate --model smollm2-135m --chat --method auto --max-new-tokens 256 \
	    --prompts-file ops --per-task 4 $(ARGS)

# the OpenAI-compatible server on the default model: auto over prompt lookup's lengths, 8 slots;
# GET /health turns 200 once every program is compiled. Then, from another shell:
#   curl http://127.0.0.1:$(PORT)/v1/chat/completions -H 'content-type: application/json' \
#     -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}'
#   .venv/bin/specjax loadbench --url http://127.0.0.1:$(PORT) --prompts-file ops \
#     --per-task 4 --chat --max-new-tokens 256 --methods none,auto --concurrency 1,4,16
serve: $(VENV)/.base
	$(VENV)/bin/specjax serve --model smollm2-135m --method auto --auto-methods ngram --slots 8 \
	    --max-tokens 256 --port $(PORT) $(ARGS)

# Two passes at once, timed together: the mesh tests (`-m mesh`, 8 fake devices, tests/test_sharding.py)
# in a process of their own, its report printed after the rest's (`-m "not mesh"`, one worker per
# core). Exit status 5 (no test selected, e.g. ARGS names another file) counts as passed. On a crash in
# native code (pytest itself dies) it prints the test that was running and every thread's stack from
# tests/conftest.py's crash log.
test: $(VENV)/.test  ## the whole suite, the real-model oracle tests included
	@start=$$(date +%s); \
	$(PY) -m pytest -q -m mesh -p no:cacheprovider --durations=5 -rs $(ARGS) > .pytest-mesh.log 2>&1 & mesh=$$!; \
	SPECJAX_CRASH_LOG=$(CURDIR)/.pytest-crash.log $(PY) -m pytest -q -m "not mesh" -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 -rs $(ARGS); rc=$$?; \
	if [ $$rc -ne 0 ] && grep -q "Fatal Python error" .pytest-crash.log 2>/dev/null; then \
	    grep -v '^running ' .pytest-crash.log | grep -v 'site-packages/pluggy' | head -200; \
	    echo "== pytest died while running: $$(grep '^running ' .pytest-crash.log | tail -1)"; fi; \
	wait $$mesh; mrc=$$?; echo "== the mesh pass (pytest -m mesh, 8 devices):"; cat .pytest-mesh.log; \
	echo "== make test: $$(( $$(date +%s) - start )) s"; \
	[ $$rc -eq 0 -o $$rc -eq 5 ] && [ $$mrc -eq 0 -o $$mrc -eq 5 ] && [ $$rc -ne 5 -o $$mrc -ne 5 ]

bench: $(VENV)/.test
	$(VENV)/bin/specjax bench $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
