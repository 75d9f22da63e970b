#!/usr/bin/env bash
# Every test of the project, Rust and Python, plus the format and lint gates. This is the
# README's test command and what CI runs (.ci/run). Sets up the venv first (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's wall time, printed at the end.
PHASES=()
phase_start=$SECONDS
phase() {
    PHASES+=("$1=$((SECONDS - phase_start))")
    phase_start=$SECONDS
}

bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

phase "setup"
echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
# `--features planner-cli/run` builds `planner run` and the runtime (libtorch) and runs their
# tests too; a plain `cargo build` / `cargo test` at the root needs neither.
echo "== cargo clippy --all-targets -D warnings" >&2
cargo clippy --workspace --all-targets --features planner-cli/run --quiet -- -D warnings
phase "fmt+clippy"
echo "== ruff check (lint, every Python file)" >&2
ruff check
echo "== mypy --strict (the package)" >&2
(cd python && mypy)
echo "== stubtest (the native extension's stub against the built module)" >&2
(cd python && python -m mypy.stubtest --mypy-config-file stubtest.ini recompute_planner._native)
phase "ruff+mypy+stubtest"
echo "== cargo test" >&2
# `planner run` loads the runtime library, which `cargo test` does not build (nothing links
# a cdylib): build it, with the binary, first.
cargo build -p planner-cli --features run --quiet
cargo test --workspace --features planner-cli/run --quiet
phase "cargo-test"

echo "== pytest" >&2
# setup.sh installed the package editable from this clone, native extension included, so a
# fresh clone reusing the cached venv tests its own sources.
# The planner the Rust tests built (a plain `cargo build -p planner-cli` would replace the
# runtime library with one without `planner run`).
# One process: a test that leaves a torch.fx.traceback annotation open (which would tag every
# later trace in the process) fails by name (tests/conftest.py).
export PLANNER_BIN="$PWD/target/debug/planner"
python -m pytest -q --durations=15 python/tests
phase "pytest"
echo "== phases (seconds): ${PHASES[*]}" >&2
