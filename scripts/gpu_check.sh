#!/usr/bin/env bash
# The CUDA and NCCL paths of `planner run`, on a machine with one or more NVIDIA GPUs: every
# joint golden whose world size fits the GPUs runs on CUDA with --check (NCCL ranks as
# threads, one GPU each; a single-rank golden is NCCL with world size 1), then, with two or
# more GPUs, one golden runs as two processes under torchrun (meeting through its store).
# Prints, per golden, measured (tracked storages and the CUDA caching allocator) vs predicted
# peak, and the median step time of 5 against the one predicted with a profile calibrated on
# this GPU first (`planner calibrate`), for the plan, no checkpointing and whole-layer
# recompute; then offload on CUDA (planner run, eager SAC, the compile stage). Exits 1 when a
# run fails.
#
#     bash scripts/gpu_check.sh [GOLDEN ...]
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

echo "== building planner with the runtime (release)" >&2
cargo build --release --quiet -p planner-cli --features run
PLANNER="$PWD/target/release/planner"

GPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_check: no CUDA device is visible" >&2
  exit 1
fi
echo "== $GPUS GPU(s): $(python -c 'import torch; print(torch.cuda.get_device_name(0))')" >&2

# Time: a profile calibrated on this GPU, which every run below is planned and timed with.
PROFILE="$PWD/target/gpu_profile.json"
echo "== calibrating (planner calibrate --device cuda)" >&2
"$PLANNER" calibrate --device cuda -o "$PROFILE"

if [ "$#" -gt 0 ]; then
  GOLDENS=("$@")
else
  GOLDENS=(dense moe_layer_compiled moe_ep2 moe_ep2_compiled moe_domino moe_ep2_unbalanced
           moe_ep4 glm_dsa_ep2 glm_dsa_ep2_compiled)
fi

world_size() {
  "$PLANNER" inspect "tests/golden/$1.pb" --format json |
    python -c 'import json, sys; print(max(1, json.load(sys.stdin).get("world_size", 1)))'
}

# The units a golden's check keeps: the DSA indexer where declared, else everything.
keep_for() {
  if "$PLANNER" inspect "tests/golden/$1.pb" | grep -q SAVE_DSA_INDEXER; then
    echo save_dsa_indexer
  else
    echo all
  fi
}

# One table row per step variant of a JSON report on stdin; exits 1 when its checks failed.
SUMMARY_PY="$(cat <<'PY'
import json, sys
name, keep = sys.argv[1], sys.argv[2]
report = json.load(sys.stdin)
mib = lambda b: f"{'-':>9}" if b is None else f"{b / 2**20:9.3f}"
for rank in report["ranks"]:
    for run in rank["runs"]:
        step = f"keep {keep}" if run["variant"] == "plan" else run["variant"]
        diff = run["peak_diff_percent"]
        diff = "-" if diff is None else f"{diff:+.1f}%"
        print(f"{name:<22} {rank['rank']:>4} {step:<24} {mib(run['measured_peak_bytes'])} "
              f"{mib(run['allocator_peak_bytes'])} {mib(run['predicted_peak_bytes'])} "
              f"{diff:>8} {run['seconds'] * 1e3:10.2f} "
              f"{(run['predicted']['step_time_s'] or 0) * 1e3:10.2f}")
if not report["passed"]:
    print(f"{name}: FAILED: {report['first_failure']}", file=sys.stderr)
sys.exit(0 if report["passed"] else 1)
PY
)"
summarise() {
  python -c "$SUMMARY_PY" "$@"
}

FAILED=0
printf '%-22s %4s %-24s %9s %9s %9s %8s %10s %10s\n' golden rank step "tracked" "allocator" \
  "predicted" diff "time (ms)" "predicted"
echo "(peaks in MiB; tracked: storages the runtime holds; allocator: CUDA caching allocator peak)"
for golden in "${GOLDENS[@]}"; do
  world="$(world_size "$golden")"
  if [ "$world" -gt "$GPUS" ]; then
    echo "$golden: needs $world GPUs, skipped" >&2
    continue
  fi
  keep="$(keep_for "$golden")"
  if ! "$PLANNER" run "tests/golden/$golden.pb" --device cuda --ranks "$world" --keep "$keep" \
      --check --format json --timeout 120 --hw "$PROFILE" --repeat 5 \
      > "target/gpu_check_$golden.json"; then
    echo "$golden: run failed" >&2
  fi
  summarise "$golden" "$keep" < "target/gpu_check_$golden.json" || FAILED=1
done

# Offload on CUDA: the runtime's host pool (what the DSA indexer keeps, and every kept output
# and layer input of the dense golden), then eager SAC and the compile stage
# (scripts/gpu_offload.py: pinned asynchronous copies, gradients against the step without).
echo "== offload (planner run on CUDA, then eager and compiled: scripts/gpu_offload.py)" >&2
for spec in "glm_dsa_ep2:save_dsa_indexer:--offload SAVE_DSA_INDEXER" \
            "dense:all:--offload-kinds kept,layer-input"; do
  IFS=: read -r golden keep offload <<< "$spec"
  world="$(world_size "$golden")"
  [ "$world" -gt "$GPUS" ] && continue
  # shellcheck disable=SC2086  # the offload options are two words
  if ! "$PLANNER" run "tests/golden/$golden.pb" --device cuda --ranks "$world" --keep "$keep" \
      $offload --check --format json --timeout 120 --hw "$PROFILE" \
      > "target/gpu_check_${golden}_offload.json"; then
    echo "$golden offloaded: run failed" >&2
  fi
  summarise "$golden (offloaded)" "$keep" < "target/gpu_check_${golden}_offload.json" || FAILED=1
done
python scripts/gpu_offload.py --device cuda || FAILED=1

if [ "$GPUS" -ge 2 ]; then
  echo "== two processes under torchrun (one GPU each, NCCL)" >&2
  LOGS="target/gpu_check_torchrun"
  rm -rf "$LOGS"
  if ! torchrun --standalone --no-python --nproc-per-node 2 --log-dir "$LOGS" --redirects 3 \
      "$PLANNER" run tests/golden/glm_dsa_ep2.pb --device cuda --keep save_dsa_indexer \
      --check --format json --timeout 120; then
    echo "torchrun: a rank failed (its stderr.log under $LOGS)" >&2
    FAILED=1
  fi
  for rank in 0 1; do
    summarise "glm_dsa_ep2 (torchrun)" save_dsa_indexer < "$(echo "$LOGS"/*/attempt_0/$rank/stdout.log)" \
      || FAILED=1
  done
fi

exit "$FAILED"
