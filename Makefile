# k3serve — setup, serve, test. Each target installs whatever is missing first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# prometheus: promtool for the rule tests, the server for `make dashboards` and its test
APT_PKGS := libibverbs1 librdmacm1 libnuma1 prometheus
# Python caches compiled modules in __pycache__ (in .venv and here) even where the environment
# asks it not to: the install skips compiling (pip --no-compile; the modules a process imports
# are compiled once, at their first import), and the suite's many processes reuse the caches.
unexport PYTHONDONTWRITEBYTECODE
HOST ?= 127.0.0.1
PORT ?= 8000
# Extra flags for `k3serve serve`, e.g. make serve ARGS="--prefill 1 --decode 2 --api-key KEY"
ARGS ?=

.PHONY: install sysdeps serve test test-fast bench dashboards plan clean

sysdeps:
	@missing=""; for p in $(APT_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing k3serve and its dependencies into $(VENV) (the first time: a few minutes)"
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -e '.[cpu,dev,ray,otel]'
	@touch $@

install: sysdeps $(VENV)/.installed

# the command is echoed with every --api-key value masked
serve: install
	@echo "$(VENV)/bin/k3serve serve --host $(HOST) --port $(PORT) $(ARGS)" \
		| sed -E ':a; s/(--api-key(=| +)(\*\*\* +)*)[^-* ][^ ]*/\1***/; ta'
	@$(VENV)/bin/k3serve serve --host $(HOST) --port $(PORT) $(ARGS)

# Prometheus (+ Grafana where grafana-server is installed) against a running stack, e.g. one
# started by `make serve`: targets from the router's worker list, dashboard deploy/grafana.
ROUTER_URL ?= http://$(HOST):$(PORT)
PROM_PORT ?= 9090
dashboards: install
	$(PY) -m deploy.monitoring up --router-url $(ROUTER_URL) --port $(PROM_PORT)

# Memory plan of a deployment config, e.g. make plan CONFIG=deploy/configs/supernode-64.yaml
CONFIG ?= deploy/configs/supernode-64.yaml
plan: install
	$(VENV)/bin/k3serve plan --config $(CONFIG)

# The full suite: every test (CPU-only tests of GPU paths included; `gpu` tests skip on CPU),
# in three phases (tests/conftest.py lists the files of the serial and stacks phases; each
# phase imports only its own files): the `serial` tests (tight latency and fault-handling
# bounds), then the `stacks` tests (processes, fake and live stacks, Ray clusters; mostly
# waiting on processes), each on two workers, one file per worker at a time; beside both, the
# in-process tests on two pytest-xdist workers under SCHED_IDLE, on the CPU time the other two
# leave idle (tests/run_suite.py; --sequential runs the phases one after another).
# Every phase runs; the target fails if any does.
test: install
	$(PY) -m tests.run_suite

# The inner-loop tier, ≤ 3 minutes on 2 cores: the unit files of the invariants, selected by
# path — cache (hashing, allocation, prefix hits), sampler, placement, hit-rate metrics,
# detokenizer and tokenizer, tool-call parser, grammar masks, store units, the simulator, the
# KDA and MLA kernels against their references at small shapes, the parallel layout, the memory
# plan and the package import rules. Tests marked `slow` in these files are left out (pytest -m).
# No live stacks, no Triton interpreter; `make test` runs everything.
FAST_TESTS := tests/cache tests/engine/test_sampler.py tests/router/test_placement.py \
	tests/router/test_placement_load.py tests/router/test_router_metrics.py \
	tests/router/test_tools_parser.py tests/tokenizer tests/structured \
	tests/kvstore/test_store_units.py tests/simulate tests/kernels/test_kda.py \
	tests/kernels/test_mla_prefill_sdpa.py \
	tests/parallel/test_parallel_layout.py tests/deploy/test_plan.py tests/test_package_imports.py
test-fast: install
	$(PY) -m pytest -q -ra -m "not slow and not gpu" $(FAST_TESTS)

# CPU benchmarks (speed is printed and written as JSON, never asserted); the gpu_*.py ones need a
# CUDA GPU and are not run here. Each writes $(BENCH_OUT)/NAME.json. Sizes are modest where a
# benchmark's own default is a long run (its --help gives the full-size flags).
BENCH_OUT ?= bench-results
CPU_BENCH := model_cpu engine_cpu transfer store router_placement grammar_mask expert_placement \
  simulate_sweep simulate_grid simulate_snapshots overload fuzz_api migration soak \
  pd_vs_monolithic calibrate_live router_relay relay_floor
SLICE := traces/mooncake_ci_slice_3940_3963.jsonl
BENCH_ARGS_simulate_sweep := $(SLICE)
BENCH_ARGS_simulate_grid := --traces $(SLICE) --policy prefix_home cache_aware
BENCH_ARGS_simulate_snapshots := $(SLICE) --models k3-tiny
BENCH_ARGS_fuzz_api := --cases 300
BENCH_ARGS_migration := --streams 16
BENCH_ARGS_soak := --duration 90 --warmup 20
BENCH_ARGS_router_relay := --rounds 1
BENCH_ARGS_relay_floor := --rounds 1
# the flag that names the JSON file, where it is not --json
BENCH_JSON_soak := --out
BENCH_JSON_pd_vs_monolithic := --out
BENCH_JSON_calibrate_live := --out
# Every benchmark runs to the end; the failed ones are listed last and make the target fail.
bench: install
	@mkdir -p $(BENCH_OUT); failed=""; \
	$(foreach b,$(CPU_BENCH),echo "== benchmarks/$(b).py"; \
	  $(PY) benchmarks/$(b).py $(BENCH_ARGS_$(b)) $(or $(BENCH_JSON_$(b)),--json) \
	    $(BENCH_OUT)/$(b).json || failed="$$failed $(b)";) \
	if [ -n "$$failed" ]; then echo "make bench: failed:$$failed"; exit 1; fi; \
	echo "make bench: all $(words $(CPU_BENCH)) CPU benchmarks finished; results in $(BENCH_OUT)/"

clean:
	rm -rf $(VENV) build *.egg-info
