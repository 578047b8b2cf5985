#!/usr/bin/env bash
# Page faults and system time of a serving worker under each native-heap policy (--malloc-mmap-threshold,
# worker_svc/executor/native_memory.py), alternated for ROUNDS rounds (default 2): a fresh worker per run, one
# warm-up batch, then 64 prompts of 128 tokens (4 out, concurrency 16) through `llmserve bench-serving`, with the
# worker's minor faults and system time from /proc/PID/stat around the second batch.
#
#   benchmarks/heap_policy_ab.sh MODEL [ROUNDS]
# POLICIES (default "keep glibc"): the --malloc-mmap-threshold values to compare.
set -euo pipefail
model=$(realpath "${1:?usage: benchmarks/heap_policy_ab.sh MODEL [ROUNDS]}")
rounds=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
out=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$out"' EXIT
port() { "$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
batch() {  # batch PORT SEED
    "$py" -m llmserve.cli bench-serving --backend worker --address "127.0.0.1:$1" --model "$model" --wait-for-server 300 \
        --dataset random --random-input-len 128 --random-output-len 4 --random-range-ratio 1 --num-prompts 64 \
        --max-concurrency 16 --seed "$2" > "$out/bench.txt" 2>&1
}
stat_field() { awk -v f="$2" '{print $f}' "/proc/$1/stat"; }  # 10: minor faults, 15: system time (ticks)
ticks=$(getconf CLK_TCK)
for round in $(seq "$rounds"); do
    for policy in ${POLICIES:-keep glibc}; do
        w=$(port)
        "$py" -m llmserve.cli worker --model "$model" --dtype bfloat16 --port "$w" --max-running-requests 64 \
            --disable-radix-cache --malloc-mmap-threshold "$policy" > "$out/worker.log" 2>&1 &
        pid=$!
        batch "$w" 1
        faults=$(stat_field "$pid" 10); sys=$(stat_field "$pid" 15)
        batch "$w" 2
        faults=$(( $(stat_field "$pid" 10) - faults )); sys=$(( ($(stat_field "$pid" 15) - sys) * 1000 / ticks ))
        echo "round $round, $policy: $faults minor faults, ${sys} ms system time; $(grep -E 'Output token throughput|Median TTFT' "$out/bench.txt" | tr -s ' ' | tr '\n' ' ')"
        kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
    done
done
