#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 600), one after the other, niced: the
# command of record in docs/fuzzing.md. New inputs go to corpus-raw/<target> (git-ignored),
# crashes to artifacts/<target>; a summary line per target goes to fuzz-runs.log.
set -uo pipefail
cd "$(dirname "$0")"
seconds=${1:-600}
for target in load_pb load_json hw_profile inspect_text convert_roundtrip plan_pb plan_json plan_graph run_inputs; do
    dict=()
    case $target in load_json | hw_profile | plan_json) dict=(-dict=dicts/json.dict) ;; esac
    # The runtime's target links libtorch: it needs `source scripts/env.sh` first.
    features=()
    case $target in run_inputs) features=(--features run) ;; esac
    mkdir -p "corpus-raw/$target" "corpus/$target"
    nice cargo +nightly fuzz run -O "${features[@]}" "$target" "corpus-raw/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 "${dict[@]}" > "logs/$target.log" 2>&1
    echo "$target exit=$? $(grep -E '^stat::number_of_executed_units' "logs/$target.log")" \
        >> fuzz-runs.log
done
