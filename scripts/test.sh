#!/usr/bin/env bash
# Every test of the project, Rust and Python, plus the format and lint gates. This is the
# README's test command and what CI runs (.ci/run). Sets up the venv first (idempotent).
#
# Steps that leave a core idle run beside each other (a build compiles one crate at a time for
# long stretches; pytest and the linters keep one core busy): each one started with `beside`
# writes to a log of its own, which `joined` prints once it has ended. The script fails if any
# step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's wall time, printed at the end.
PHASES=()
phase_start=$SECONDS
phase() {
    PHASES+=("$1=$((SECONDS - phase_start))")
    phase_start=$SECONDS
}

LOGS="$(mktemp -d)"
declare -A STARTED
FAILED=()
# On any exit (a failed step under `set -e`, Ctrl-C), the steps still running in the background
# end too, with every process they started (each runs in a session of its own).
end_started() {
    local pid
    for pid in "${STARTED[@]}"; do
        kill -- -"$pid" 2>/dev/null || true
    done
    rm -rf "$LOGS"
}
trap end_started EXIT
trap 'exit 130' INT TERM

# beside NAME COMMAND...: runs COMMAND in the background, its output in NAME's log.
beside() {
    local name="$1"
    shift
    echo "== $name (in the background; its output follows when it ends)" >&2
    setsid -w "$@" >"$LOGS/$name" 2>&1 &
    STARTED[$name]=$!
}

# joined NAME: waits for NAME, prints its output and notes whether it failed.
joined() {
    local name="$1" status=0
    wait "${STARTED[$name]}" || status=$?
    echo "== $name (output)" >&2
    cat "$LOGS/$name" >&2
    if [ "$status" != 0 ]; then
        echo "error: $name exited $status" >&2
        FAILED+=("$name")
    fi
}

# stop_if_failed: ends the script when a step it depends on failed.
stop_if_failed() {
    if [ "${#FAILED[@]}" != 0 ]; then
        echo "error: failed: ${FAILED[*]}" >&2
        exit 1
    fi
}

# The linters: ruff (every Python file), mypy --strict (the package), stubtest (the native
# extension's stub against the built module).
LINT='set -e
echo "== ruff check"; ruff check
echo "== mypy"; (cd python && mypy)
echo "== stubtest"
(cd python && python -m mypy.stubtest --mypy-config-file stubtest.ini recompute_planner._native)'

bash scripts/setup.sh --venv-only
# shellcheck source=scripts/env.sh
source scripts/env.sh

# The build folder. A fresh clone's own `target/` compiles every dependency again in each of the
# four builds below (clippy's check, the dev build, the tests, the extension's release build),
# several CPU-minutes of this suite. The test command builds in a folder kept beside the venv
# instead, keyed by Cargo.lock, the compiler and the venv (torch-sys records its libtorch's
# path), so a later clone (CI's, every time) compiles only this workspace's crates. Those
# always compile again: their fingerprints are removed first, so no clone can be handed another
# clone's build of its own sources whatever the files' times (cargo judges a path crate by
# modification times); dependencies are pinned by Cargo.lock and reused. One run holds the
# folder at a time (a lock, held by this script and what it starts); a run that finds it busy,
# that cannot lock (no flock, no writable cache), or that is given a target folder
# (CARGO_TARGET_DIR, CARGO_BUILD_TARGET_DIR) builds where cargo would. Other keys' folders are
# removed when free; lock files stay, so two runs never lock two files of one name.
shared_build_folder() {
    local root="$HOME/.cache/recompute-planner" key dir lock old
    command -v flock >/dev/null && mkdir -p "$root" 2>/dev/null || return 0
    key="$({ cat Cargo.lock; rustc -vV; echo "$PLANNER_VENV"; } | sha256sum | cut -c1-16)"
    dir="$root/cargo-target-$key"
    if ! { exec 9>>"$dir.lock"; } 2>/dev/null || ! flock -n 9; then
        echo "== build folder $dir is in use by another run (or cannot be locked): building in ./target" >&2
        exec 9>&-
        return 0
    fi
    for lock in "$root"/cargo-target-*.lock; do
        old="${lock%.lock}"
        [ "$old" = "$dir" ] && continue
        (flock -n 8 && rm -rf "$old") 8>>"$lock" || true
    done
    mkdir -p "$dir"
    forget_workspace_builds "$dir"
    export CARGO_TARGET_DIR="$dir"
    echo "== build folder: $dir (dependencies reused, this workspace compiled again)" >&2
}

# forget_workspace_builds DIR: removes the fingerprints of this workspace's crates (library,
# binaries, tests, build scripts, in every profile) from DIR, so cargo compiles them again.
forget_workspace_builds() {
    local names
    names="$(cargo metadata --no-deps --offline --format-version 1 \
        | python -c 'import json, sys; print("|".join(p["name"] for p in json.load(sys.stdin)["packages"]))')"
    find "$1" -mindepth 3 -maxdepth 5 -type d -path '*/.fingerprint/*' \
        -regextype posix-extended -regex ".*/\.fingerprint/($names)-[0-9a-f]{16}" \
        -prune -exec rm -rf {} +
}

if [ -z "${CARGO_TARGET_DIR:-}${CARGO_BUILD_TARGET_DIR:-}" ]; then
    shared_build_folder
fi
TARGET="${CARGO_TARGET_DIR:-${CARGO_BUILD_TARGET_DIR:-target}}"

# The package (its native extension: a release build) installs beside fmt and clippy (a check
# build, in another profile's folder, so neither waits for the other's lock).
beside setup bash scripts/setup.sh
echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
# `--features planner-cli/run` builds `planner run` and the runtime (libtorch) and runs their
# tests too; a plain `cargo build` / `cargo test` at the root needs neither.
echo "== cargo clippy --all-targets -D warnings" >&2
cargo clippy --workspace --all-targets --features planner-cli/run --quiet -- -D warnings
joined setup
stop_if_failed
phase "setup+fmt+clippy"

# The linters read the built package; they run beside the planner's build.
beside lint bash -c "$LINT"
echo "== cargo build (the planner and its runtime library)" >&2
# `planner run` loads the runtime library, which `cargo test` does not build (nothing links
# a cdylib): build it, with the binary, first.
cargo build -p planner-cli --features run --quiet
# pytest runs a copy: the Rust tests' build beside it may write the binary again.
mkdir -p target/pytest-planner
cp "$TARGET/debug/planner" "$TARGET/debug/libplanner_run.so" target/pytest-planner/
joined lint
stop_if_failed
phase "lint+build"

# The Rust tests (their build first) run beside pytest. The tests that compare times measured
# apart (the Rust one that checks a calibrated prediction against a measured step, pytest's
# marked `timed`: a budget answer ranked by measured time, ...) run afterwards, alone, so a
# neighbour's load cannot skew one of their timings against another.
TIMED_RUST_TEST=a_calibrated_profile_is_read_by_hw_and_predicts_the_measured_step
beside cargo-test cargo test --workspace --features planner-cli/run --quiet -- \
    --skip "$TIMED_RUST_TEST"
echo "== pytest" >&2
# setup.sh installed the package editable from this clone, native extension included, so a
# fresh clone reusing the cached venv tests its own sources. One process: a test that leaves a
# torch.fx.traceback annotation open (which would tag every later trace in the process) fails
# by name (tests/conftest.py).
export PLANNER_BIN="$PWD/target/pytest-planner/planner"
pytest_status=0
python -m pytest -q --durations=15 -m "not timed" python/tests || pytest_status=$?
case "$pytest_status" in
    0) ;;
    2) exit 130 ;;  # interrupted (Ctrl-C)
    *) FAILED+=(pytest) ;;
esac
joined cargo-test
echo "== cargo test and pytest (the timed tests, alone)" >&2
cargo test -p planner-cli --features run --quiet --test calibrate -- --exact "$TIMED_RUST_TEST" \
    || FAILED+=(timed-cargo-test)
pytest_status=0
python -m pytest -q --durations=5 -m timed python/tests || pytest_status=$?
case "$pytest_status" in
    0 | 5) ;;  # 5: none selected (PYTEST_ADDOPTS may deselect every timed test)
    2) exit 130 ;;
    *) FAILED+=(timed-pytest) ;;
esac
phase "cargo-test+pytest"
echo "== phases (seconds): ${PHASES[*]}" >&2
stop_if_failed
