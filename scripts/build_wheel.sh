#!/usr/bin/env bash
# Builds the wheel to hand out: one abi3 wheel (CPython 3.10 and later) tagged manylinux_2_28,
# so it installs on glibc 2.28 or newer (RHEL/Rocky 8, Ubuntu 20.04, the NGC PyTorch images),
# with its native library stripped (`strip` in python/pyproject.toml) and the `planner` command
# inside. The native code links through zig (maturin --zig, the `ziglang` wheel), which targets
# glibc 2.28 from any build machine, as a manylinux_2_28 container would; maturin checks the
# library's symbol versions against the tag and refuses a newer one.
#
#     bash scripts/build_wheel.sh [--profile release|dev] [--out DIR]   # default: release, dist/
#
# Needs the project venv (scripts/setup.sh installs maturin and ziglang into it).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
out=dist
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "usage: $0 [--profile release|dev] [--out DIR]" >&2; exit 2 ;;
  esac
done
out="$(mkdir -p "$out" && cd "$out" && pwd)"

source scripts/env.sh
cd python
maturin build --locked --profile "$profile" --zig --compatibility manylinux_2_28 \
  --out "$out" >&2
ls "$out"/recompute_planner-*-manylinux_2_28_*.whl
