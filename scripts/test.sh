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

bash scripts/setup.sh --venv-only
# shellcheck source=scripts/env.sh
source scripts/env.sh

# The package (its native extension: a release build) installs beside fmt and clippy (a check
# build, in another profile's folder): each leaves a core idle for long stretches (one crate
# compiling at a time). Its output follows clippy's.
setup_log="$(mktemp)"
trap 'rm -f "$setup_log"' EXIT
bash scripts/setup.sh >"$setup_log" 2>&1 &
package_setup=$!
echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
# `--features planner-cli/run` builds `planner run` and the runtime (libtorch) and runs their
# tests too; a plain `cargo build` / `cargo test` at the root needs neither.
echo "== cargo clippy --all-targets -D warnings" >&2
cargo clippy --workspace --all-targets --features planner-cli/run --quiet -- -D warnings
echo "== setup (the package, built beside clippy)" >&2
setup_status=0
wait "$package_setup" || setup_status=$?
cat "$setup_log" >&2
if [ "$setup_status" != 0 ]; then
    echo "error: scripts/setup.sh exited $setup_status" >&2
    exit 1
fi
phase "setup+fmt+clippy"
echo "== ruff check (lint, every Python file)" >&2
ruff check
echo "== mypy --strict (the package)" >&2
(cd python && mypy)
echo "== stubtest (the native extension's stub against the built module)" >&2
(cd python && python -m mypy.stubtest --mypy-config-file stubtest.ini recompute_planner._native)
phase "ruff+mypy+stubtest"
echo "== cargo build (the planner, its runtime library, every Rust test)" >&2
# `planner run` loads the runtime library, which `cargo test` does not build (nothing links
# a cdylib): build it, with the binary, first.
cargo build -p planner-cli --features run --quiet
cargo test --workspace --features planner-cli/run --no-run --quiet
phase "rust-build"

# The Rust tests run in the background beside pytest: pytest keeps about one of this
# machine's cores busy, and the Rust tests fill much of the other. Their output follows
# pytest's. The one test that compares a calibrated prediction with a time it measures runs
# afterwards, alone, so a neighbour's load cannot skew one of its two timings.
TIMED_RUST_TEST=a_calibrated_profile_is_read_by_hw_and_predicts_the_measured_step
rust_log="$(mktemp)"
trap 'rm -f "$setup_log" "$rust_log"' EXIT
echo "== cargo test (in the background; its output follows pytest's)" >&2
cargo test --workspace --features planner-cli/run --quiet -- --skip "$TIMED_RUST_TEST" \
    >"$rust_log" 2>&1 &
rust_tests=$!

echo "== pytest" >&2
# setup.sh installed the package editable from this clone, native extension included, so a
# fresh clone reusing the cached venv tests its own sources.
# The planner the Rust build made (a plain `cargo build -p planner-cli` would replace the
# runtime library with one without `planner run`).
# One process: a test that leaves a torch.fx.traceback annotation open (which would tag every
# later trace in the process) fails by name (tests/conftest.py).
export PLANNER_BIN="$PWD/target/debug/planner"
pytest_status=0
python -m pytest -q --durations=15 python/tests || pytest_status=$?
rust_status=0
wait "$rust_tests" || rust_status=$?
echo "== cargo test (output)" >&2
cat "$rust_log"
cargo test -p planner-cli --features run --quiet --test calibrate -- "$TIMED_RUST_TEST"
phase "cargo-test+pytest"
echo "== phases (seconds): ${PHASES[*]}" >&2
if [ "$pytest_status" != 0 ] || [ "$rust_status" != 0 ]; then
    echo "error: pytest exited $pytest_status, cargo test $rust_status" >&2
    exit 1
fi
