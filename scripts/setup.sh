#!/usr/bin/env bash
# Idempotent setup: a Python venv with the pinned torch (libtorch for tch) and the Python test
# dependencies. The venv lives outside the clone, keyed by the torch version, so a fresh clone
# (CI) reuses it. Prints nothing but progress on stderr; safe to run any number of times.
set -euo pipefail

TORCH_VERSION=2.13.0  # keep in sync with scripts/env.sh and tch in Cargo.toml
VENV="${PLANNER_VENV:-$HOME/.cache/recompute-planner/venv-torch-$TORCH_VERSION}"
PY_DEPS=("torch==$TORCH_VERSION" "protobuf>=6.31,<7" "grpcio-tools>=1.74" "pytest>=8" "safetensors>=0.4" "numpy>=1.26")
STAMP="$VENV/.planner-setup-ok"

want_stamp() { printf '%s\n' "${PY_DEPS[@]}"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(want_stamp)" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "setup: creating $VENV (torch $TORCH_VERSION, about a minute)" >&2
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
"$VENV/bin/python" -m pip install --quiet "${PY_DEPS[@]}" >&2
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__" >&2
want_stamp > "$STAMP"
echo "setup: done" >&2
