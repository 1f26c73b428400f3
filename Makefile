# The two commands a new user runs: `make demo` and `make test`. Both create/refresh .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BUILD  ?= build

.PHONY: venv docs demo test test-fast test-kernels test-seeds test-gpu gpu-lint gpu-check lint bench docker clean

venv: $(STAMP)

# The CUDA major of the stack .venv gets: torch and DALI of one major (docs/gpu.md#the-cuda-stack). 13 is what
# PyPI's torch is built for (driver R580 or newer); `make venv CUDA_MAJOR=12` for an R525-R575 driver, with torch
# from PyTorch's CUDA 12 index (after `rm .venv/.installed` on an existing .venv). The other major's DALI is
# removed first: both builds install into one nvidia/dali folder.
CUDA_MAJOR ?= 13
# gpu-check and test-gpu on a host without a package registry (or in the image): `PY=python3` names the Python that
# has the stack, and no .venv is made.
GPU_CHECK_DEPS := $(if $(filter command line,$(origin PY)),,venv)
OTHER_DALI  := $(if $(filter 12,$(CUDA_MAJOR)),nvidia-dali-cuda130,nvidia-dali-cuda120)
TORCH_INDEX := $(if $(filter 12,$(CUDA_MAJOR)),--extra-index-url https://download.pytorch.org/whl/cu126)

# Re-install only when the project's declared dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored: it is neither" || true
	$(PY) -m pip uninstall -q -y $(OTHER_DALI) 2>&1 | grep -v "not installed" || true
	$(PY) -m pip install -q -e '.[dev,cuda$(CUDA_MAJOR)]' $(TORCH_INDEX) 2>&1 | grep -v "is ignored: it is neither" || true
	$(PY) -c "import dalifeed, nvidia.dali, webdataset, torch, torchvision, sklearn, skimage"
	@# the stack check every GPU command makes: on a node whose GPUs this stack cannot use, stop here and say why
	@$(PY) -m dalifeed.cli doctor > $(VENV)/doctor.txt || { cat $(VENV)/doctor.txt; echo "make: if the driver needs the other \
	  CUDA major: rm $(STAMP) && make venv CUDA_MAJOR=$(if $(filter 12,$(CUDA_MAJOR)),13,12)"; exit 1; }
	touch $(STAMP)

demo: venv
	$(PY) -m dalifeed.demo --workdir $(BUILD)/demo $(DEMO_ARGS)

# --durations: where the suite's time goes, the 20 slowest tests, printed at the end of every run
test: venv lint
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The tests whose asserted numbers go through torch's or oneDNN's SIMD kernels (marked `kernels`, and the `learns`
# tests), once under each kernel family this CPU has: AVX-512 where /proc/cpuinfo lists it, AVX2, and the `default`
# (SSE4.1) code every x86-64 CPU runs. A result that holds only on one family's rounding fails here. DALI's CPU
# operators, PIL and numpy do not read these variables: a test of them alone is not re-run.
CPU_FLAGS       := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
KERNEL_FAMILIES := $(if $(filter 4,$(words $(filter avx512f avx512bw avx512vl avx512dq,$(CPU_FLAGS)))),avx512) \
                   $(if $(filter avx2,$(CPU_FLAGS)),avx2) default
KERNELS_avx512  := ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=DEFAULT
KERNELS_avx2    := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
KERNELS_default := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41
test-kernels: venv
	@set -e; $(foreach family,$(KERNEL_FAMILIES),\
	  echo "== make test-kernels: $(family) kernels ($(KERNELS_$(family)))"; \
	  env $(KERNELS_$(family)) $(PY) -m pytest -q -m "kernels or learns" $(PYTEST_ARGS);)

# The tests that assert on a training outcome (marked `learns`), once for each seed in SEEDS: they must pass
# for every seed, not for the one they were written with.
SEEDS ?= 0 1 2 3 4
test-seeds: venv
	@set -e; for seed in $(SEEDS); do \
	  echo "== make test-seeds: DALIFEED_TEST_SEED=$$seed"; \
	  DALIFEED_TEST_SEED=$$seed $(PY) -m pytest -q -m learns $(PYTEST_ARGS); \
	done

# The tests marked gpu (tests/test_gpu.py): they need a CUDA GPU that torch and DALI both see. `make test` on a
# CPU machine runs them as skips; `make test-gpu` where torch sees no GPU stops with exit 3 and one line saying
# why (tests/conftest.py), never green with every test skipped. `make test-gpu PY=python` uses that Python's
# stack, as gpu-check does (the Docker image: docker/README.md).
test-gpu: $(GPU_CHECK_DEPS)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# Every DALI graph dalifeed builds for `gpu` and `hybrid`, checked without a GPU (tests/test_gpu_graphs.py,
# docs/development/gpu-evidence.md): each operator has a backend for its device and a GPU kernel for the dtype and
# layout it receives (tests/gpu_kernels.py), every argument is in its schema and current, and the graph equals the cpu
# graph but for device strings and the mixed decoders' hints. `make test` runs it too.
gpu-lint: venv
	$(PY) -m pytest -q tests/test_gpu_graphs.py $(PYTEST_ARGS)

# The Python code (ruff: pyflakes, pycodestyle, import order, bugbear, pyupgrade; pyproject.toml), the docs site
# (mkdocs.yml, strict: a broken link or API reference fails it; into build/site), the shell scripts and the
# Dockerfile, checked with the tools the dev extra installs (no Docker needed).
SHELL_SCRIPTS := $(wildcard examples/slurm/*.sbatch) .ci/run
lint: venv
	$(VENV)/bin/ruff check dalifeed tests examples
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	for f in $(SHELL_SCRIPTS); do bash -n "$$f" || exit 1; done
	$(VENV)/bin/shellcheck $(SHELL_SCRIPTS)
	$(VENV)/bin/hadolint docker/Dockerfile

# The reference site (docs/ and the API pages generated from the docstrings) into build/site.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "docs: $(BUILD)/site/index.html"

# On a GPU node: the gpu tests, every loader, hw_decoder_load, a ResNet-50 training slice, a mixed checkpoint
# round trip, the collectives, every training recipe per dtype and layout -> build/gpu-check/gpu-check.{json,md}
# (docs/benchmarks.md; `python -m dalifeed.bench.gpu_check --help` lists the steps). On a host without a
# package registry, name the Python that has the stack: `make gpu-check PY=python3` (no .venv is made then).
gpu-check: $(GPU_CHECK_DEPS)
	$(PY) -m dalifeed.bench.gpu_check --workdir $(BUILD)/gpu-check $(GPU_CHECK_ARGS)

# The peers it races (the `peers` extra) are installed here only: make test never needs them.
bench: venv
	$(PY) -m pip install -q -e '.[peers]' 2>&1 | grep -v "is ignored: it is neither" || true
	$(PY) -m dalifeed.bench.make_bench --workdir $(BUILD)/bench --doc docs/benchmarks.md

docker:
	docker build -f docker/Dockerfile -t dalifeed:latest .

clean:
	rm -rf $(BUILD) .pytest_cache
