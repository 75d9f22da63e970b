#!/usr/bin/env bash
# Idempotent setup: a Python venv with the pinned torch (libtorch for tch), the Python test
# dependencies and maturin, then the `recompute_planner` package of this clone installed into
# it (editable, with its native extension). The venv lives outside the clone, keyed by the
# torch version, so a fresh clone (CI) reuses it; the package is reinstalled from the clone
# that runs this, which costs an incremental cargo build. Prints nothing but progress on
# stderr; safe to run any number of times.
#
#     bash scripts/setup.sh              # the venv, then the package
#     bash scripts/setup.sh --venv-only  # the venv alone (scripts/test.sh builds the package
#                                        # beside its first Rust checks)
set -euo pipefail
cd "$(dirname "$0")/.."

venv_only=false
case "${1:-}" in
  "") ;;
  --venv-only) venv_only=true ;;
  *) echo "usage: $0 [--venv-only]" >&2; exit 2 ;;
esac

TORCH_VERSION=2.13.0  # keep in sync with scripts/env.sh and tch in Cargo.toml
VENV="${PLANNER_VENV:-$HOME/.cache/recompute-planner/venv-torch-$TORCH_VERSION}"
# transformers: the HuggingFace model families the exporter is tested on (tiny configs, random
# weights, nothing downloaded). ruff, mypy and protobuf's stubs: the lint and type gates of
# scripts/test.sh, pinned so a new release's rules do not fail an unchanged tree. ziglang: the
# linker scripts/build_wheel.sh builds the manylinux_2_28 wheel with (tested by test_wheel.py).
PY_DEPS=("torch==$TORCH_VERSION" "protobuf>=6.31,<7" "pytest>=8" "safetensors>=0.4" "numpy>=1.26" "maturin>=1.9.4,<2" "transformers==5.23.0" "ruff==0.17.6" "mypy==2.4.1" "types-protobuf==6.32.1.20260221" "ziglang==0.17.1")
STAMP="$VENV/.planner-setup-ok"

want_stamp() { printf '%s\n' "${PY_DEPS[@]}"; }

if ! { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(want_stamp)" ] && [ -x "$VENV/bin/python" ]; }; then
  echo "setup: creating $VENV (torch $TORCH_VERSION, about a minute)" >&2
  mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet "${PY_DEPS[@]}" >&2
  "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__" >&2
  want_stamp > "$STAMP"
  echo "setup: venv done" >&2
fi

if "$venv_only"; then
  exit 0
fi

# The package of this clone, with the planner as its native extension (maturin builds
# python/native), optimised: the in-process planner (rp.plan, the compile stage) is several
# times slower unoptimised. PLANNER_NATIVE_PROFILE=dev builds it with the workspace's debug
# build instead, in a fraction of the time, for quick iterations on the Rust code.
echo "setup: installing recompute_planner from $PWD/python" >&2
# The extension is built for the stable ABI (`_native.abi3.so`); an older checkout's
# interpreter-specific build would shadow it on import.
rm -f python/recompute_planner/_native.cpython-*.so
# Linked through zig for glibc 2.28, as scripts/build_wheel.sh links the wheel: the same cargo
# build, so the wheel of the same profile (tests/test_wheel.py) reuses it instead of compiling
# every crate again.
PATH="$VENV/bin:$PATH" \
  MATURIN_PEP517_ARGS="--profile ${PLANNER_NATIVE_PROFILE:-release} --zig --compatibility manylinux_2_28" \
  "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e python >&2
