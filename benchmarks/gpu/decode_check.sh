#!/usr/bin/env bash
# The CUDA-graph decode check for a machine with a CUDA GPU, one command, under 10 minutes:
#   1. the HF oracle on the device (bench-one-batch --correct) with CUDA graphs on (the default on CUDA:
#      the three prompts' decode steps replay the batch-4 graph, one padding row) and off, each pair
#      decoding the same greedy tokens: the Llama model in fp32, a tiny DeepSeek-V2 (MLA, MoE) in bf16
#      (its grouped MoE GEMMs run on the device only in bf16 on sm90/sm100; fp32 ones loop on the host,
#      so its fp32 oracle runs with graphs resolved off);
#   2. decode timing at bs 1 and bs 16 (bf16), graphs off and on, medians side by side.
# A run with graphs on must log "cuda graphs captured" (the script fails otherwise), so "on" never
# silently measures the eager path.
#
#   benchmarks/gpu/decode_check.sh [MODEL]          # default: a generated bench-preset Llama
#
# DEVICE=cpu runs the same commands on the CPU, where graphs resolve off (tests/unit/
# test_decode_check_script.py does, with a tiny model and DECODE_QUICK=1 for small sizes).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py="${PYTHON:-$root/.venv/bin/python}"
device=${DEVICE:-cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=${1:-}
if [ -z "$model" ]; then
    model="$work/bench"
    "$py" -m llmserve.cli make-model --arch llama --preset "${DECODE_PRESET:-bench}" --out "$model" >/dev/null
fi
if [ "$device" = cuda ]; then
    gpus=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    [ "$gpus" -ge 1 ] || { echo "no CUDA device visible (DEVICE=cpu runs the CPU parts)"; exit 2; }
    sm=$("$py" -c "import torch; print(torch.cuda.get_device_capability()[0])")
    expect="cuda graphs captured"
    if [ "$sm" = 9 ] || [ "$sm" = 10 ]; then moe_expect=$expect; else moe_expect="cuda graphs off"; fi
else
    sm=none
    expect="cuda graphs off"
    moe_expect=$expect
fi
if [ "${DECODE_QUICK:-0}" = 1 ]; then sizes=(--batch-size 1 4 --input-len 16 --output-len 4); else
    sizes=(--batch-size 1 16 --input-len 128 --output-len 64 --repeats 3); fi

# run NAME GRAPHS WANT ARGS...: bench-one-batch, its output kept in $work/NAME.log; GRAPHS "off" adds
# --disable-cuda-graph; WANT (unless empty) must appear in its log.
run() {
    local name=$1 graphs=$2 want=$3
    shift 3
    local flags=()
    [ "$graphs" = off ] && flags=(--disable-cuda-graph)
    "$py" -m llmserve.cli bench-one-batch --device "$device" "$@" "${flags[@]}" >"$work/$name.log" 2>&1 \
        || { cat "$work/$name.log"; echo "== $name: bench-one-batch failed"; exit 1; }
    grep -E "cuda graphs|max \|ours - HF\||Correctness check|median latency" "$work/$name.log" || true
    if [ -n "$want" ] && ! grep -q "$want" "$work/$name.log"; then
        echo "== $name: expected '$want' in its log"; exit 1
    fi
}

# oracle NAME MODEL DTYPE WANT: the HF oracle with graphs on (WANT in its log) and off; both must pass and
# decode the same greedy tokens.
oracle() {
    local name=$1 dir=$2 dtype=$3 want=$4 graphs
    for graphs in on off; do
        echo "== 1. HF oracle, $name ($dtype), CUDA graphs $graphs"
        local need=""
        [ "$graphs" = on ] && need=$want
        run "oracle-$name-$graphs" "$graphs" "$need" --model "$dir" --dtype "$dtype" --correct --output-len 8 \
            --result-file "$work/oracle-$name-$graphs.json"
    done
    "$py" -c '
import json, sys
on, off = ([p["output_ids"] for p in json.load(open(path))["prompts"]] for path in sys.argv[1:])
print("== greedy tokens, graphs on vs off:", "same" if on == off else f"DIFFER: {on} vs {off}")
sys.exit(on != off)' "$work/oracle-$name-on.json" "$work/oracle-$name-off.json"
}

echo "== device $device (sm $sm), model $model"
"$py" -m llmserve.cli make-model --arch deepseek_v2 --preset tiny --out "$work/deepseek" >/dev/null
oracle llama "$model" float32 "$expect"
oracle deepseek "$work/deepseek" bfloat16 "$moe_expect"
echo "== 1. HF oracle, deepseek (float32), CUDA graphs as resolved"
run oracle-deepseek-fp32 auto "" --model "$work/deepseek" --dtype float32 --correct --output-len 8
for graphs in off on; do
    echo "== 2. decode timing (bf16), CUDA graphs $graphs"
    need=""
    [ "$graphs" = on ] && need=$expect
    run "timing-$graphs" "$graphs" "$need" --model "$model" --dtype bfloat16 "${sizes[@]}" \
        --result-file "$work/timing-$graphs.json"
done
"$py" -c '
import json, statistics, sys

def medians(path):
    by_bs = {}
    for r in json.load(open(path)):
        by_bs.setdefault(r["batch_size"], []).append(r["median_decode_latency"])
    return {bs: statistics.median(v) for bs, v in by_bs.items()}

off, on = medians(sys.argv[1]), medians(sys.argv[2])
print("== decode step, median ms: batch  graphs off  graphs on  speedup")
for bs in sorted(off):
    print(f"   {bs:5d}  {1e3 * off[bs]:10.3f}  {1e3 * on[bs]:9.3f}  {off[bs] / on[bs]:6.2f}x")' \
    "$work/timing-off.json" "$work/timing-on.json"
