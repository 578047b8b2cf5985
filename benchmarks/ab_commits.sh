#!/usr/bin/env bash
# bench-one-batch of the working tree against an earlier commit, interleaved in rounds on the same
# cores (TP=1, 2 threads, bf16, bs 1 and 16, input 128, output 16), the order swapped every round.
# The earlier commit runs from a temporary git worktree, removed afterwards.
#
#   benchmarks/ab_commits.sh BASE_REV MODEL [ROUNDS]
#
# REPEATS=N (default 1) measures each batch size N times per run (--repeats): one 128-token prefill
# takes ~0.1 s, so a single one per run is noisy. EXTRA_FLAGS are passed to both sides (e.g.
# "--cpu-bf16-linear aten" to hold a later kernel change out of the comparison). BATCHES (default "1 16") and
# INPUT_LEN (default 128) change the shapes.
set -euo pipefail
base_rev=${1:?usage: benchmarks/ab_commits.sh BASE_REV MODEL [ROUNDS]}
model=$(realpath "${2:?model folder}")
rounds=${3:-3}
repeats=${REPEATS:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
git -C "$root" worktree add --detach "$work/base" "$base_rev" >/dev/null
trap 'git -C "$root" worktree remove --force "$work/base"; rm -rf "$work"' EXIT
for round in $(seq "$rounds"); do
    order="base head"; [ $((round % 2)) = 0 ] && order="head base"  # ABBA: a drift within a round hits both sides
    for side in $order; do
        src=$root; [ "$side" = base ] && src=$work/base
        (cd "$src" && PYTHONPATH=$src "$root/.venv/bin/python" -m llmserve.cli bench-one-batch --model "$model" \
            --dtype bfloat16 --batch-size ${BATCHES:-1 16} --input-len "${INPUT_LEN:-128}" --output-len 16 --threads 2 \
            --max-total-tokens $(( (${INPUT_LEN:-128} + 16) * 64 + 64 )) --repeats "$repeats" ${EXTRA_FLAGS:-} --result-file "$work/${side}_${round}.json" >/dev/null 2>&1)
    done
done
"$root/.venv/bin/python" - "$work" "$rounds" ${BATCHES:-1 16} <<'PY'
import json, statistics, sys
work, rounds, batches = sys.argv[1], int(sys.argv[2]), [int(b) for b in sys.argv[3:]]
for side in ("base", "head"):
    results = [result for r in range(1, rounds + 1) for result in json.load(open(f"{work}/{side}_{r}.json"))]
    for bs in batches:
        mine = [r for r in results if r["batch_size"] == bs]
        steps = [r["median_decode_latency"] * 1e3 for r in mine]
        prefill = [r["prefill_throughput"] for r in mine]
        print(f"{side} bs{bs}: decode ms {' / '.join(f'{s:.1f}' for s in steps)} (median {statistics.median(steps):.1f}), "
              f"prefill tok/s {' / '.join(f'{p:.0f}' for p in prefill)} (median {statistics.median(prefill):.0f})")
PY
