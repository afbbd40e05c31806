# The README's two commands: `make demo` and `make test`. Both set up .venv from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Warm compiler caches that live with the checkout, not in /tmp. Inductor's cache does not see a custom op's
# fake change shape, so its folder is named by the source of the kernels and the registry.
SOURCE := $(shell cat registry/*.py registry/*/*.py kernels/*.py kernels/*/*.py 2>/dev/null | cksum | cut -d' ' -f1)
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor-$(SOURCE)
export NUMBA_CACHE_DIR ?= $(CURDIR)/.cache/numba

.PHONY: test test-hf-oldest demo bench lint clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Two workers (tests/README.md: what they share, how tests are grouped); the slowest tests listed at the end.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# The main job: record the example's training step (a Hugging Face Llama patched with the pack), tune
# every call site against the compiler (studies in the embedded SQLite default, so a second run reuses
# them), show the table, then verify the full step: the table against every kernel off and every kernel
# on, and each enabled entry switched off alone. The demo tunes for peak memory, "never more memory, then the
# time rule": a kernel is enabled where it lowers its region's peak by 10% or more and is not slower (the fused
# head and loss, at under half its peak), or where its peak is the compiler's and
# it is faster; `nki-autotune run` alone tunes for time.
# The Hugging Face tests against the oldest transformers the `hf` extra admits (kernels/hf/version.py: SUPPORTED),
# in a venv of its own; `make test` tests the newest.
HF_OLDEST      ?= 4.57
OLDEST_VENV    := .venv-hf-oldest
OLDEST_STAMP   := $(OLDEST_VENV)/.installed-$(HF_OLDEST)
$(OLDEST_STAMP): pyproject.toml setup.py
	test -x $(OLDEST_VENV)/bin/python || python3 -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q torch==2.13.0
	$(OLDEST_VENV)/bin/python -m pip install -q -e '.[dev]' 'transformers==$(HF_OLDEST).*'
	touch $@

test-hf-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests/test_hf.py tests/test_trainer.py

demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/nki-autotune record -o out/profile.yaml -- $(PY) examples/train.py --steps 3
	$(VENV)/bin/nki-autotune run out/profile.yaml -o out/dispatch.yaml --trials 2 --objective memory
	$(VENV)/bin/nki-autotune show out/dispatch.yaml
	$(VENV)/bin/nki-autotune verify out/dispatch.yaml examples/train.py:make_step --rounds 8 --json out/verify.json

bench: $(STAMP)
	$(PY) -m pytest benchmarks -q --timeout 1200 --benchmark-columns=median,iqr,rounds --benchmark-sort=name

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .cache build *.egg-info
