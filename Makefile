# Two entry points: `make demo` (set up, then profile an unmodified example script) and `make test` (set up, test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Users bring their own torch; this pins the CPU build used for development and CI.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo doctor-demo test lint bench docs clean system-packages

# The demos need the package alone; the tests need every extra (the trackers, Lightning, transformers, Ray, ...).
# Bytecode is written as modules are first imported, not by pip: of the 22,700 files installed, the suite imports a
# few thousand, and compiling all of them (pip on one core, or compileall on every core) cost 30-45 s of set-up. The
# environment may set PYTHONDONTWRITEBYTECODE; the recipes here drop it, or each of the suite's hundreds of
# processes would compile torch's modules again (1.3 s each).
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH_SPEC)
	$(PY) -m pip install -q --no-compile -e .
	touch $@

# The extras are ~150 packages: pip takes ~45 s to resolve and unpack them (twice that beside a busy loop per core), uv
# ~5 s. torch stays the build .base installed (pinned: uv must never swap in another build of it); where uv cannot be
# had, pip installs the same.
$(VENV)/.installed: $(VENV)/.base
	echo '$(TORCH_SPEC)' > $(VENV)/torch-pin.txt
	($(PY) -m pip install -q --no-compile uv && $(VENV)/bin/uv pip install -q --python $(PY) -c $(VENV)/torch-pin.txt -e '.[dev]') \
	  || $(PY) -m pip install -q --no-compile -e '.[dev]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/stepscope run --warmup 10 --steps 50 --json out/demo-summary.json examples/plain_train.py

doctor-demo: $(VENV)/.base
	$(VENV)/bin/stepscope doctor --warmup 10 --steps 50 --json out/doctor-summary.json examples/plain_train.py

# Two workers: the suite holds on a loaded machine, and a third was no faster quiet and slower beside busy loops. A
# module's tests that share a module-scoped fixture stay on one worker (tests/conftest.py groups them), so the
# training run (or Ray) they share starts once: most of the suite's time is training processes' start-up (torch and
# torch._dynamo, ~2.5 s of CPU each), which is why tests of figures run their script inside the test process
# (tests/run_helpers.py, cli_here). The other tests spread freely (whole files per worker left one worker alone on
# the slowest file).
test: $(VENV)/.installed lint system-packages
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

# The HTML report's render test loads the page in headless Chromium, and the allocator test preloads jemalloc. Install
# Debian's packages of what is missing where apt-get can (CI runs as root on a fresh machine); where it cannot, the
# set-up goes on and those tests skip.
system-packages:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	ldconfig -p 2>/dev/null | grep -q libjemalloc || missing="$$missing libjemalloc2"; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "could not install$$missing: the tests that need them will skip"; \
	  else \
	    echo "no apt-get to install$$missing: the tests that need them will skip"; \
	  fi; \
	fi

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

bench: $(VENV)/.installed
	$(PY) bench/overhead.py

# docs/fixes.md is generated from the fix catalogue (a test checks it is current).
docs: $(VENV)/.installed
	$(PY) -m stepscope.doctor.rules > docs/fixes.md

clean:
	rm -rf $(VENV) out .pytest_cache
