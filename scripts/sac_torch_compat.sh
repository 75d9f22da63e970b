#!/usr/bin/env bash
# Runs the eager SAC tests (python/tests/test_sac.py) under another torch release than the one
# the project pins, e.g. the oldest python/pyproject.toml declares:
#
#     bash scripts/sac_torch_compat.sh 2.9.1
#
# The torch release gets a venv of its own ($SAC_COMPAT_VENV, else one per version beside
# the project's), with the test dependencies and nothing of the project installed: the tests
# import the package from this clone, whose native extension is built for the stable ABI and
# so needs no rebuild per torch (scripts/setup.sh builds it once). torch comes from PyPI with
# its CUDA libraries (a few GB on Linux x86_64). Tests that export a graph or run the zoo's
# multi-rank models are skipped on torch older than the exporter's (the test file says why).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: $0 TORCH_VERSION [PYTEST_ARGS...]   (e.g. 2.9.1)" >&2
  exit 2
fi
TORCH_VERSION=$1
shift
VENV="${SAC_COMPAT_VENV:-$HOME/.cache/recompute-planner/venv-sac-torch-$TORCH_VERSION}"
DEPS=("torch==$TORCH_VERSION" "protobuf>=6.31,<7" "pytest>=8" "safetensors>=0.4" "numpy>=1.26")

if ! ls python/recompute_planner/_native.abi3.so >/dev/null 2>&1; then
  echo "sac_torch_compat: no native extension in python/recompute_planner;" \
    "run scripts/setup.sh first" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "sac_torch_compat: creating $VENV (torch $TORCH_VERSION)" >&2
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "${DEPS[@]}" >&2
"$VENV/bin/python" -c \
  "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"

cd python
exec "$VENV/bin/python" -m pytest -q -rs tests/test_sac.py "$@"
