#!/usr/bin/env bash
# One GPU session of issue 12: the `gpu` tests and benchmarks/gpu_step.py on a lent machine (the
# `device` tool, /work/.library/device/README.md), tables written under $OUT.
#
# Here, in the repository root, once (the wheels the machine lacks, 52 MiB; it has torch, transformers,
# accelerate, pandas, pyarrow, pytest, but no pydantic, math-verify, trl, datasets; nothing can be
# fetched there):
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
WHEELS=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
# datasets 5.2 needs pyarrow >= 24; the machine's pyarrow version is not on record, so a 47 MiB wheel
# rides along in .whl/fallback/ and is installed only where the machine's is older (carry limit: 64 MiB).
PYARROW_MIN=24
PYARROW_FALLBACK=pyarrow==24.0.0

download() {  # DIR SPEC...: the wheels for the device machine's Python (CPython 3.12, Linux x86-64)
  local dir="$1"
  shift
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}

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
    exclude="$(git rev-parse --git-path info/exclude)"  # .git/info may be absent, and .git is a file in a worktree
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
    download .whl "${WHEELS[@]}" && download .whl/fallback "$PYARROW_FALLBACK" || exit 1
    du -sh .whl
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
