#!/usr/bin/env bash
# The radix cache's TTFT on bench-serving's shared-prefix dataset (issue 16, acceptance 2): a fresh worker with
# the cache and one with --disable-radix-cache, alternated for ROUNDS rounds (default 2, the order swapped each
# round), `llmserve bench-serving --backend worker --dataset shared-prefix` (4 prefixes x 512 tokens, 64-token
# suffixes, 32 out, 64 requests, concurrency 8), straight to the worker. Prints each run's TTFT p50 / mean,
# throughput and the prompt tokens the cache served (usage's cached_tokens), then cache on / off TTFT p50 per round.
#
#   benchmarks/prefix_cache_ab.sh MODEL [ROUNDS]
# WORKER_FLAGS: extra worker flags for both sides. OUT_DIR: where the reports go (default a temp dir).
set -euo pipefail
model=$(realpath "${1:?usage: benchmarks/prefix_cache_ab.sh MODEL [ROUNDS]}")
rounds=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
out=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$out"
port() { "$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true' EXIT
run() {  # run NAME EXTRA_WORKER_FLAGS...
    local name=$1; shift
    local w
    w=$(port)
    "$py" -m llmserve.cli worker --model "$model" --dtype bfloat16 --port "$w" \
        --max-running-requests 64 ${WORKER_FLAGS:-} "$@" > "$out/worker_$name.log" 2>&1 &
    pid=$!
    "$py" -m llmserve.cli bench-serving --backend worker --address "127.0.0.1:$w" --model "$model" \
        --wait-for-server 300 --dataset shared-prefix --num-prefixes 4 --prefix-len 512 --suffix-len 64 \
        --output-len 32 --num-prompts 64 --max-concurrency 8 --output-file "$out/$name.jsonl" > "$out/$name.txt" 2>&1
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
}
for round in $(seq "$rounds"); do
    order="cache nocache"; [ $((round % 2)) = 0 ] && order="nocache cache"
    for side in $order; do
        if [ "$side" = cache ]; then run "cache_r$round"; else run "nocache_r$round" --disable-radix-cache; fi
    done
done
"$py" - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def summary(name):
    rows = [json.loads(line) for line in open(f"{out}/{name}.jsonl") if line.strip()]
    s = next(r for r in rows if "median_ttft_ms" in r)
    print(f"{name}: TTFT p50 {s['median_ttft_ms']:.0f} ms, mean {s['mean_ttft_ms']:.0f} ms, "
          f"{s['output_throughput']:.1f} output tok/s, cached prompt tokens {s['cache_hit_rate']:.3f}")
    return s["median_ttft_ms"]

for r in range(1, rounds + 1):
    on, off = summary(f"cache_r{r}"), summary(f"nocache_r{r}")
    print(f"round {r}: cache on / off TTFT p50 {off / on:.2f}x")
PY
echo "reports in $out"
