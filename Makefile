# The two commands a fresh machine needs: `make demo` and `make test`
# (`make system-deps` first installs the Debian packages the tests use; needs root).
# Everything installs into .venv (created on first use from python3.11 or python3).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[envoy,sim,test]'
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the tests run (as root, as CI is): prometheus brings prometheus and
# promtool for the Grafana dashboard's PromQL and e2e/test_prometheus.py.
system-deps:
	command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

demo: $(STAMP)
	$(VENV)/bin/extproc demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench.prefix
	$(PY) -m bench.picker

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
