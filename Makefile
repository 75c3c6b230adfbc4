# Every target sets itself up: a venv in .venv with the CPU build of torch, then the package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build; an unpinned torch would pull a multi-GB CUDA build. pyproject states the range.
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test bench bench-targets gpu-check stress experiment lint format clean

# DS_BUILD_OPS=0: DeepSpeed (a test extra) builds from its sdist, with no C++/CUDA ops (it
# compiles an op when one is used). The torch pin again, so that no extra swaps the CPU build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[test]' $(TORCH_PIN)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

# mergekit 0.1.5, the merge benchmark's comparison, in a venv of its own (its pins are not
# ours); the torch pin first, so that no CUDA build is fetched. If it cannot be built the
# benchmark says so and skips only the mergekit rows.
MERGEKIT_VENV ?= .venv-mergekit

$(MERGEKIT_VENV)/bin/mergekit-yaml:
	-( $(PYTHON) -m venv $(MERGEKIT_VENV) && $(MERGEKIT_VENV)/bin/python -m pip install -q $(TORCH_PIN) \
	  && $(MERGEKIT_VENV)/bin/python -m pip install -q mergekit==0.1.5 $(TORCH_PIN) ) \
	  || echo "bench: could not build $(MERGEKIT_VENV) (mergekit 0.1.5): the mergekit rows will be skipped"

# Each script runs through targets.py --time, which records its wall time and exit status (a
# failing script stops no other); the scripts that measure the issues' targets write their figures
# as JSON into $(BENCH_RESULTS); the last line prints the targets table from them and the walls.
BENCH_RESULTS ?= bench-results
TARGETS := CKPTAVG_BENCH_RESULTS=$(BENCH_RESULTS) $(PY) benchmarks/targets.py
TIMED := $(TARGETS) --time --

bench: $(STAMP) $(MERGEKIT_VENV)/bin/mergekit-yaml
	$(TARGETS) --start
	$(TIMED) $(PY) benchmarks/bench_merge.py
	$(TIMED) $(PY) benchmarks/bench_megatron_table.py
	$(TIMED) $(PY) benchmarks/bench_layouts_small.py
	$(TIMED) $(PY) benchmarks/bench_layouts_dcp.py
	$(TIMED) $(PY) benchmarks/bench_dcp_chunks.py
	$(TIMED) $(PY) benchmarks/bench_weighted.py
	$(TIMED) $(PY) benchmarks/bench_processes.py
	$(TIMED) $(PY) benchmarks/bench_hook.py
	$(TIMED) $(PY) benchmarks/bench_torchtitan_hook.py
	$(TIMED) $(PY) benchmarks/bench_formats.py
	$(TIMED) $(PY) benchmarks/bench_scale.py
	$(TIMED) $(PY) benchmarks/bench_startup.py
	$(TIMED) $(PY) benchmarks/bench_s3_latency.py
	$(TIMED) $(PY) benchmarks/bench_sweep.py
	$(TARGETS)

# Only the scripts that measure a target, then the table: bench_merge without its mergekit and
# 16-input cases (its merge / floor is case a's).
bench-targets: $(STAMP)
	$(TARGETS) --start
	$(TIMED) $(PY) benchmarks/bench_merge.py --no-large --scale-inputs 0
	$(TIMED) $(PY) benchmarks/bench_layouts_small.py
	$(TIMED) $(PY) benchmarks/bench_layouts_dcp.py
	$(TIMED) $(PY) benchmarks/bench_weighted.py
	$(TIMED) $(PY) benchmarks/bench_processes.py
	$(TARGETS)

# The hook on a GPU: merge correctness and step-time overhead on a ~1B-parameter model, every=1.
# Needs a GPU and a CUDA build of torch in the venv (TORCH_PIN); says so in one line otherwise.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

# kill -9 at random points of a merge, then --resume: 25 trials (make test runs 3).
stress: $(STAMP)
	CKPTAVG_KILL_TRIALS=25 $(PY) -m pytest -q -s tests/merging/test_crash_safety.py

# Does averaging help? A byte-level LM on the standard library's .py files, two seeds in
# parallel (~2-4 min on 2 cores): table on stdout, plot and JSON in experiment-out/.
experiment: $(STAMP)
	$(PY) examples/experiment.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache demo-run experiment-out bench-results
