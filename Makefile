# Two entry points: `make demo` (set up, then profile an unmodified example script) and `make test` (set up, test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Users bring their own torch; this pins the CPU build used for development and CI.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo doctor-demo test lint bench docs clean chromium

# The demos need the package alone; the tests need every extra (the trackers, Lightning, transformers, Ray, ...).
# pip compiles each package's bytecode on one core; compileall on every core once the packages are in is ~40 s
# faster on 2 cores (and the bytecode must be written: the environment may set PYTHONDONTWRITEBYTECODE). Like pip,
# it goes on past the files of other Python versions that some packages ship (its exit code says 1 for them).
COMPILE = $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH_SPEC)
	$(PY) -m pip install -q --no-compile -e .
	$(COMPILE)
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	$(COMPILE)
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/stepscope run --warmup 10 --steps 50 --json out/demo-summary.json examples/plain_train.py

doctor-demo: $(VENV)/.base
	$(VENV)/bin/stepscope doctor --warmup 10 --steps 50 --json out/doctor-summary.json examples/plain_train.py

# Two workers (the suite holds on a loaded machine), then the tests that want the machine to themselves.
# The suite starts hundreds of stepscope processes: each would compile stepscope's modules again without bytecode (0.12 s;
# the editable install leaves src/ uncompiled, and PYTHONDONTWRITEBYTECODE may forbid writing it as they run).
test: $(VENV)/.installed lint chromium
	$(PY) -m compileall -q -j 0 src >/dev/null
	$(PY) -m pytest -q -n 2 -m "not serial" --durations=15
	$(PY) -m pytest -q -m serial --durations=5

# The HTML report's render test loads the page in headless Chromium. Install Debian's when it is missing and
# apt-get can (CI runs as root on a fresh machine); where it cannot, the set-up goes on and that test skips.
chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "chromium could not be installed: the HTML render test will skip"; \
	  else \
	    echo "no chromium and no apt-get: the HTML render test will skip"; \
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
