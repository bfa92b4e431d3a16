# The two commands a fresh machine needs: `make test` and `make bench`.
# Each sets up .venv when it is missing and does nothing extra when it exists.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: test test-unit test-stress test-costs bench bench-full wheel-check lint venv clean

$(STAMP): pyproject.toml ray_rdt_pool/memory/native/_copy.c ray_rdt_pool/memory/native/_native.cpp
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch is pinned to 2.13.0 here because that release's CPU build lies on this
	# machine's disk; an unpinned torch would pull a multi-GB CUDA build. The
	# package itself asks only for a range.
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[dev]"
	# The two optional compiled helpers (the copy in C, describe() in C++ against this
	# torch), into the user cache; without compilers the package runs memmove and its
	# Python loop instead.
	$(VPY) -m ray_rdt_pool.memory.native build --optional
	touch $(STAMP)

venv: $(STAMP)

# The tests run on TEST_WORKERS pytest processes. Each runs one Ray cluster, shared by
# its cluster modules, and a cluster module runs whole on one of them (tests/conftest.py
# makes the work units xdist's scopes), longest first. One more process than this
# machine's two cores: the tests wait (timeouts, lingers, drivers starting) as much as
# they compute, and a third process fills those waits (about 0.75x the time of two on
# the 2-core VM). TEST_WORKERS=0 runs them all in this one process. The 25 slowest
# phases are listed at the end: runs of one tree differ by up to a fifth here, and a CI
# log should say where. The multi-node test bed's own test (network namespaces, root
# only: a tool of the benchmarks, not a promise of the transport) runs in make
# test-stress.
TEST_WORKERS ?= 3
UNIT_WORKERS ?= 2
PYTEST := $(VPY) -m pytest -q -rs

test: $(STAMP)
	$(VPY) -m ruff check ray_rdt_pool tests microbenchmarks examples
	$(VPY) -m mypy
	$(PYTEST) -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(TEST_PATHS) \
	    --ignore=tests/stress/test_testbed.py --durations=25

# What make test runs: the tests, and the microbenchmarks' check of themselves.
TEST_PATHS := tests microbenchmarks/test_put_phases.py

# The tests that need no Ray cluster (tests/unit/), test by test on UNIT_WORKERS processes.
test-unit: $(STAMP)
	$(PYTEST) -n $(UNIT_WORKERS) tests/unit microbenchmarks/test_put_phases.py

# The cost table the scheduler of make test hands out work by (tests/conftest.py),
# measured: a whole run with --durations=0, whose per-test times tools/test_costs.py sums
# per work unit and writes into the table. Run it after adding or changing slow tests.
test-costs: $(STAMP)
	$(VPY) tools/test_costs.py --workers $(TEST_WORKERS) -- $(TEST_PATHS) \
	    --ignore=tests/stress/test_testbed.py

# The chaos run and the multi-node test bed's test.
test-stress: $(STAMP)
	$(PYTEST) -n $(UNIT_WORKERS) --dist loadscope --no-loadscope-reorder tests/stress

# The optional TransferQueue variant of the benchmark; a failed install only skips it.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(VPY) -m pip install -q -e ".[bench]" || echo "TransferQueue not installed: its benchmark variant is skipped"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(VENV)/bin/ray-rdt-pool bench --quick --out bench-results

bench-full: $(BENCH_STAMP)
	$(VENV)/bin/ray-rdt-pool bench --out bench-results

# A wheel of this checkout, installed from outside the repository into a fresh venv,
# runs examples/put_get.py and `ray-rdt-pool doctor` (tools/check_wheel.sh). Not part of
# `make test`: it installs torch and the wheel's dependencies into a new venv.
wheel-check:
	bash tools/check_wheel.sh

lint: $(STAMP)
	$(VPY) -m ruff check ray_rdt_pool tests microbenchmarks examples
	$(VPY) -m mypy

clean:
	rm -rf $(VENV) bench-results
