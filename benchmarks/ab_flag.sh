#!/usr/bin/env bash
# bench-one-batch with and without one engine flag, interleaved in rounds on the same cores (TP=1, 2
# threads, bf16, bs 1 and 16, input 128, output 64), the order swapped every round; prints each round's
# median decode step and prefill, and the ratios of the medians.
#
#   benchmarks/ab_flag.sh MODEL FLAG [ROUNDS]       e.g. benchmarks/ab_flag.sh .models/smollm2-135m-instruct --disable-fused-layers
#
# EXTRA_FLAGS are passed to both sides (e.g. "--torchao-config int4wo-32 --quantize-lm-head"). BATCHES (default
# "1 16") and INPUT_LEN (default 128) change the shapes. FLAG may hold a value: "--malloc-mmap-threshold glibc".
set -euo pipefail
model=$(realpath "${1:?usage: benchmarks/ab_flag.sh MODEL FLAG [ROUNDS]}")
flag=${2:?the engine flag to compare}
rounds=${3:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq "$rounds"); do
    order="without with"; [ $((round % 2)) = 0 ] && order="with without"
    for side in $order; do
        flags=${EXTRA_FLAGS:-}; [ "$side" = with ] && flags="$flags $flag"
        (cd "$root" && .venv/bin/python -m llmserve.cli bench-one-batch --model "$model" --dtype bfloat16 \
            --batch-size ${BATCHES:-1 16} --input-len "${INPUT_LEN:-128}" --output-len 64 --threads 2 \
            --max-total-tokens $(( (${INPUT_LEN:-128} + 64) * 64 + 64 )) $flags \
            --result-file "$work/${side}_${round}.json" >/dev/null 2>&1)
    done
done
"$root/.venv/bin/python" - "$work" "$rounds" "$flag" <<'PY'
import json, statistics, sys
work, rounds, flag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for field, label in (("median_decode_latency", "decode step"), ("prefill_latency", "prefill")):
    steps = {side: {} for side in ("without", "with")}
    for side in steps:
        for r in range(1, rounds + 1):
            for row in json.load(open(f"{work}/{side}_{r}.json")):
                steps[side].setdefault(row["batch_size"], []).append(1e3 * row[field])
    for bs in sorted(steps["without"]):
        a, b = steps["without"][bs], steps["with"][bs]
        print(f"bs{bs} {label}: without {flag}: " + " / ".join(f"{v:.2f}" for v in a) + f" ms; with: "
              + " / ".join(f"{v:.2f}" for v in b) + f" ms; with / without (medians): {statistics.median(b) / statistics.median(a):.2f}")
PY
