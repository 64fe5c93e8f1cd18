#!/usr/bin/env bash
# One GPU session of issue 12: the `gpu` tests and benchmarks/gpu_step.py on a lent machine (the
# `device` tool, /work/.library/device/README.md), tables written under $OUT.
#
# Here, in the repository root, once (the wheels the machine lacks, benchmarks/gpu_wheels.txt; nothing
# can be fetched there):
#     bash benchmarks/gpu_session.sh fetch
# Then one device `run` per phase (each ends well inside the 10-minute limit of a call), naming
# `.whl` in carry:
#     bash benchmarks/gpu_session.sh tests            # pytest -m gpu (~3 min)  -> $OUT/gpu_tests.txt
#     bash benchmarks/gpu_session.sh bench 0.5b       # postrl + TRL, 3 steps   -> $OUT/gpu_step_0.5b.{txt,json}
#     STEPS=2 bash benchmarks/gpu_session.sh bench 1.5b
#     LORA=64 STEPS=2 bash benchmarks/gpu_session.sh bench 7b   (LoRA adapters in both frameworks)
# The printed tables go into docs/gpu.md ("Measured").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/postrl_gpu_out}"
mkdir -p "$OUT"
PYARROW_MIN=24  # datasets 5.2's floor: benchmarks/gpu_wheels.txt's fallback pyarrow is installed below it

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  if ! python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < $PYARROW_MIN)" 2>/dev/null \
    && ls .whl/fallback/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fallback/*.whl || exit 1
  fi
  export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
  python3 -c "import pyarrow, trl; print('trl', trl.__version__, 'pyarrow', pyarrow.__version__)" 2>&1 | tail -1 | tee -a "$OUT/device.txt"
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1 | tee -a "$OUT/device.txt"
}

case "${1:-}" in
  fetch)  # on the machine that has PyPI, not on the device
    bash scripts/gpu_check.sh fetch
    ;;
  tests)
    setup
    timeout 540 python3 -m pytest -q -m gpu -rs tests/test_gpu.py tests/test_structure.py 2>&1 | tee "$OUT/gpu_tests.txt"
    ;;
  bench)
    setup
    shift
    for shape in "${@:-0.5b}"; do
      timeout 560 python3 benchmarks/gpu_step.py --shapes "$shape" --steps "${STEPS:-3}" --peer trl --lora-rank "${LORA:-0}" \
        --out "$OUT/gpu_step_$shape.json" 2>&1 | tee "$OUT/gpu_step_$shape.log" | grep -v "it/s]" | tail -8 | tee "$OUT/gpu_step_$shape.txt"
    done
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh fetch | tests | bench SHAPE..." >&2
    exit 2
    ;;
esac
