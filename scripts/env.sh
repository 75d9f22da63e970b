# Source this file: puts the project venv's python first on PATH and points tch at its libtorch.
# Expects scripts/setup.sh to have run (scripts/test.sh runs it first).
PLANNER_TORCH_VERSION=2.13.0
export PLANNER_VENV="${PLANNER_VENV:-$HOME/.cache/recompute-planner/venv-torch-$PLANNER_TORCH_VERSION}"
export PATH="$PLANNER_VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
_planner_torch_lib="$("$PLANNER_VENV/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export LD_LIBRARY_PATH="$_planner_torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _planner_torch_lib
