# The README's two commands: `make demo` and `make test`. Both set up .venv from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Warm compiler caches that live with the checkout, not in /tmp.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The main job: record the example's training step, tune every call site against the compiler
# (studies in the embedded SQLite default, so a second run reuses them), show the table, then A/B/C
# the full step with the table, every kernel off and every kernel on.
demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/nki-autotune record -o out/profile.yaml -- $(PY) examples/train.py --steps 3
	$(VENV)/bin/nki-autotune run out/profile.yaml -o out/dispatch.yaml --trials 10
	$(VENV)/bin/nki-autotune show out/dispatch.yaml
	$(PY) examples/ab.py --table out/dispatch.yaml --rounds 20

bench: $(STAMP)
	$(PY) -m pytest benchmarks -q --benchmark-columns=median,iqr,rounds --benchmark-sort=name

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .cache build *.egg-info
