#!/usr/bin/env bash
# Eager selective checkpointing's time and memory on a GPU against the plan
# (scripts/time_check.py), for a GPU machine that has torch (2.9 to 2.13) and Python but
# neither this project's build nor a package registry. Two steps:
#
#     bash scripts/gpu_time.sh bundle DIR        # here: the native extension (stripped), the
#                                                # protobuf wheel the package needs, and each
#                                                # case's step traced for CUDA (fake tensors)
#     bash scripts/gpu_time.sh run DIR [OUT]     # there: calibrates the GPU, then measures
#
# `run` installs the wheel under /tmp (not into the machine's Python), puts the extension
# beside the package's sources and writes the table (OUT/time_check.md) and every row
# (OUT/time_check.json).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  bundle)
    DIR=${2:?usage: gpu_time.sh bundle DIR}
    bash scripts/setup.sh
    # shellcheck source=scripts/env.sh
    source scripts/env.sh
    mkdir -p "$DIR/whl"
    strip -o "$DIR/_native.abi3.so" python/recompute_planner/_native.abi3.so
    PROTOBUF="$(python -c 'import google.protobuf as p; print(p.__version__)')"
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d "$DIR/whl" "protobuf==$PROTOBUF"
    python scripts/time_check.py export "$DIR/graphs" --device cuda
    ;;
  run)
    DIR=${2:?usage: gpu_time.sh run DIR [OUT]}
    OUT=${3:-target/gpu_time}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$DIR"/whl/*.whl
    cp "$DIR/_native.abi3.so" python/recompute_planner/
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv || true
    PYTHONPATH="/tmp/site:$PWD/python" PYTHONUNBUFFERED=1 python3 scripts/time_check.py measure \
      "$DIR/graphs" --device cuda --json "$OUT/time_check.json" | tee "$OUT/time_check.md"
    cp "$DIR/graphs/profile_cuda.json" "$OUT/" 2>/dev/null || true
    ;;
  *)
    echo "usage: gpu_time.sh bundle DIR | run DIR [OUT]" >&2
    exit 2
    ;;
esac
