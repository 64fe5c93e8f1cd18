#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py, docs/gpu.md "The GPU check") in one line, from the repository root:
#   bash scripts/gpu_check.sh fetch              here, with PyPI: the wheels of benchmarks/gpu_wheels.txt into .whl/
#   bash scripts/gpu_check.sh OUT_DIR [ARGS...]  on the GPU machine (device `run`, carry [".whl"]): install them, run
set -euo pipefail
cd "$(dirname "$0")/.."
wheels() { grep -v '^\s*#' benchmarks/gpu_wheels.txt | grep "$@" | awk 'NF {print $1}'; }
if [ "${1:-}" = fetch ]; then
  exclude="$(git rev-parse --git-path info/exclude)"  # .whl/ travels as a carried path, never as a commit
  mkdir -p "$(dirname "$exclude")" && { grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"; }
  get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
  get .whl $(wheels -v '# fallback') && get .whl/fallback $(wheels '# fallback')
  du -sh .whl
  exit 0
fi
out="${1:?usage: bash scripts/gpu_check.sh fetch | OUT_DIR [gpu_check.py arguments]}"
shift
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
if ls .whl/*.whl >/dev/null 2>&1; then pipi .whl/*.whl; fi
if ls .whl/fallback/*.whl >/dev/null 2>&1 && ! python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)"; then
  pipi .whl/fallback/*.whl
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec python3 benchmarks/gpu_check.py --out "$out" "$@"
