#!/usr/bin/env bash
# Every test of the project, Rust and Python, plus the format and lint gates. This is the
# README's test command and what CI runs (.ci/run). Sets up the venv first (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -D warnings" >&2
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo test" >&2
cargo test --workspace --quiet

if compgen -G "python/tests/test_*.py" >/dev/null; then
  echo "== pytest" >&2
  python -m pytest -q python/tests
else
  echo "== pytest: no Python tests yet (python/tests/test_*.py)" >&2
fi
