# fastio: `make demo` and `make test` install what they need on first use.
PYTHON ?= python3
VENV   ?= .venv
# The torch requirement. The default is the CPU build this machine carries;
# on a GPU node override it, e.g. `make install TORCH=torch EXTRAS=cuda12,dev`.
TORCH  ?= torch==2.13.0
EXTRAS ?= cuda13,dev
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
LITDATA_STAMP := $(VENV)/.litdata-installed
TRL_STAMP := $(VENV)/.trl-installed
ENERGON_STAMP := $(VENV)/.energon-installed

.PHONY: install demo test test-slurm test-bench bench bench-gpu lint docs clean

install: $(STAMP)

# QUIET_EDITABLE: setuptools' "Editable installation" banner (a warning about same-named folders) is not shown.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

# STEP: one line before each step of an install, as `pip -q` prints nothing while it works (about a minute with a
# wheel cache; without one, torch alone downloads for minutes).
STEP = @echo "$(1) [$(2)] $(3)"

# megatron-core (the token interop tests only: it needs none of its dependencies to read .idx), torchdata
# (StatefulDataLoader, a peer of the restart benchmark only) and transformers (the chat tests' reference for ids and
# assistant masks, and the chat benchmark's peer: what it imports, huggingface_hub, safetensors, regex, pyyaml,
# packaging, tqdm, comes with the dev extra's packages) come without their dependencies: torch stays the pinned one;
# so does torchft-nightly (the torchft tests and bench; the wheel runs on CPU torch), whose import needs opentelemetry.
$(STAMP): pyproject.toml Makefile
	$(call STEP,make install,1/8,a virtual environment in $(VENV))
	@$(PYTHON) -m venv $(VENV)
	$(call STEP,make install,2/8,pip itself)
	@$(BIN)/pip install -q --upgrade pip
	$(call STEP,make install,3/8,$(TORCH): the largest download; minutes without a wheel cache)
	@$(BIN)/pip install -q "$(TORCH)"
	$(call STEP,make install,4/8,fastio (editable) with the extras $(EXTRAS) and their dependencies)
	@$(QUIET_EDITABLE) $(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(call STEP,make install,5/8,megatron-core without its dependencies: the token interop tests read .idx with it)
	@$(BIN)/pip install -q --no-deps "megatron-core>=0.12"
	$(call STEP,make install,6/8,torchdata 0.11.0 without its dependencies: the restart benchmark's StatefulDataLoader peer)
	@$(BIN)/pip install -q --no-deps "torchdata==0.11.0"
	$(call STEP,make install,7/8,transformers 5.23.0 without its dependencies: the chat tests' apply_chat_template reference)
	@$(BIN)/pip install -q --no-deps "transformers==5.23.0"
	$(call STEP,make install,8/8,torchft-nightly without its dependencies and the opentelemetry it imports: the torchft tests)
	@$(BIN)/pip install -q --no-deps "torchft-nightly==2026.10.26"
	@$(BIN)/pip install -q "opentelemetry-sdk>=1.39" "opentelemetry-exporter-otlp-proto-http>=1.39"
	@touch $(STAMP)
	@echo "make install: done ($(VENV))"

demo: $(STAMP)
	$(BIN)/python examples/demo.py demo-out

# The documentation site with its API reference (mkdocs.yml), into site/, browsable from disk (file://).
# --strict: a broken link, anchor or reference fails the build. The `docs`-marked tests build it again and
# browse every page in headless Chromium (links, anchors, no raw Sphinx roles). Installs the `docs` extra and
# (as root, where missing) Debian's chromium on first use; without chromium the browser test skips, saying why.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest -q -m docs
	@echo "docs: open site/index.html (file://$(CURDIR)/site/index.html)"

$(DOCS_STAMP): $(STAMP)
	$(call STEP,make docs,1/2,the docs extra (mkdocs))
	$(QUIET_EDITABLE) $(BIN)/pip install -q -e ".[$(EXTRAS),docs]"
	$(call STEP,make docs,2/2,Debian's chromium for the docs browser test where it is missing (as root))
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	touch $(DOCS_STAMP)

# The quick path: everything but the real-Slurm tests (those start daemons and take minutes: make test-slurm)
# and the site build (it needs the docs extra: make docs). Two pytest-xdist worker processes, one test file
# at a time each (a file's tests stay together, in order, on one worker; each worker has its own tmp dirs,
# moto server and session fixtures), the slowest files first (tests/conftest.py's SLOW_FILES; without
# --no-loadscope-reorder xdist would hand out the files with the most tests first): about half the time of
# one process (docs/development.md).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slurm and not docs and not bench" -n 3 --dist loadfile --no-loadscope-reorder

# The real Slurm tests (root): a one-node cluster, and a two-node cluster in network namespaces on a private
# bridge (DDP training with preemption + requeue + resume, the conversion array job + merge). About 2 minutes.
test-slurm: $(STAMP)
	command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v ip >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2)
	$(BIN)/python -m pytest -q -m slurm

# Results go to bench/out/ (not tracked by git); bench/results/ holds committed reference results.
bench: test-bench $(LITDATA_STAMP) $(TRL_STAMP) $(ENERGON_STAMP)
	$(BIN)/python -m bench.run

# The benchmark harness end to end at tiny sizes (the `bench`-marked tests, about a minute): `make bench` runs them
# before it measures; `make test` leaves them out (checks of the benchmarks, not of fastio).
test-bench: $(STAMP)
	$(BIN)/python -m pytest -q -m bench -n 2 --dist loadfile

# litdata for the tokens section's TokensLoader peer only, without its dependencies (they would replace torch;
# what it imports, boto3, requests, lightning-utilities and filelock, comes with the dev extra)
$(LITDATA_STAMP): $(STAMP)
	$(call STEP,make bench,1/3,litdata 0.2.76 without its dependencies: the tokens section's peer)
	$(BIN)/pip install -q --no-deps "litdata==0.2.76"
	touch $(LITDATA_STAMP)

# TRL for the chat section's packing peer only (pack_dataset(strategy="bfd")), without its dependencies (torch,
# transformers and accelerate stay the pinned ones). What trl.data_utils imports beyond the dev extra: datasets (pyarrow), which imports dill,
# multiprocess and pandas (pandas' python-dateutil comes with the dev extra's botocore); each --no-deps too.
$(TRL_STAMP): $(STAMP)
	$(call STEP,make bench,2/3,trl 1.16.0 and datasets 5.2.0 without their dependencies: the chat section's bfd peer)
	$(BIN)/pip install -q --no-deps "trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" \
		"pandas==3.1.1"
	touch $(TRL_STAMP)

# Megatron-Energon for the image_text section's second peer, without its dependencies (its s3fs -> aiobotocore pin
# would replace the dev extra's botocore, which boto3 and moto need); what it imports beyond the dev extra, each
# --no-deps too: multi-storage-client and the packages that imports.
$(ENERGON_STAMP): $(STAMP)
	$(call STEP,make bench,3/3,megatron-energon 7.4.1 without its dependencies: the image_text section's peer)
	$(BIN)/pip install -q --no-deps "megatron-energon==7.4.1" "multi-storage-client==1.3.1" "xattr==1.3.1" \
		"wcmatch==10.2.1" "bracex==3.2.4" "lark==1.3.1" "prettytable==3.19.0" "wcwidth==0.9.5" "pyroute2==0.9.7" \
		"tzdata==2025.3" "deprecation==2.1.0" "filetype==1.2.0" "rapidyaml==0.15.2" "mfusepy==3.1.1"
	touch $(ENERGON_STAMP)

bench-gpu: $(STAMP)
	bash bench/gpu.sh

lint: $(STAMP)
	$(BIN)/ruff check fastio converters tests bench examples

clean:
	rm -rf $(VENV) demo-out bench/work bench/out site .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
