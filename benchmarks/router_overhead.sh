#!/usr/bin/env bash
# The router's own share of TTFT and E2E, paired over the same requests in one run (issue 16, acceptance 4):
# a tokenizer, a worker and a router with Prometheus metrics; `llmserve bench-serving` through the router at
# each concurrency; the router's and the worker's own histograms (time_to_first_token_seconds,
# e2e_request_latency_seconds) are scraped after each run, and their mean difference is what the router adds
# (tokenization, the worker hop, relaying and detokenizing the first token). Unlike two end-to-end runs
# compared, the run-to-run spread cancels.
#
#   benchmarks/router_overhead.sh MODEL [CONCURRENCY ...]   (default 16 64)
# ROUTER_FLAGS: extra router flags (e.g. "--detokenize service"). WORKER_FLAGS: extra worker flags.
set -euo pipefail
model=$(realpath "${1:?usage: benchmarks/router_overhead.sh MODEL [CONCURRENCY ...]}"); shift
levels=(16 64); [ $# -gt 0 ] && levels=("$@")
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
out=$(mktemp -d)
port() { "$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
w=$(port); wm=$(port); t=$(port); r=$(port); rm=$(port)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
"$py" -m llmserve.cli worker --model "$model" --dtype bfloat16 --port "$w" --metrics-port "$wm" \
    --max-running-requests 64 --disable-radix-cache ${WORKER_FLAGS:-} > "$out/worker.log" 2>&1 & pids+=("$!")
"$py" -m llmserve.cli tokenizer --model "$model" --port "$t" > "$out/tokenizer.log" 2>&1 & pids+=("$!")
"$py" -m llmserve.cli router --tokenizer "127.0.0.1:$t" --workers "127.0.0.1:$w" --port "$r" --metrics-port "$rm" \
    --max-concurrent-requests 256 ${ROUTER_FLAGS:-} > "$out/router.log" 2>&1 & pids+=("$!")
scrape() {  # scrape PORT -> "ttft_sum ttft_count e2e_sum e2e_count"
    curl -s "127.0.0.1:$1/metrics" | "$py" -c '
import sys
v = {}
for line in sys.stdin:
    if line.startswith("llmserve:") and " " in line:
        name, value = line.rsplit(" ", 1); v[name] = float(value)
p = "llmserve:"
print(v[p + "time_to_first_token_seconds_sum"], v[p + "time_to_first_token_seconds_count"],
      v[p + "e2e_request_latency_seconds_sum"], v[p + "e2e_request_latency_seconds_count"])'
}
for c in "${levels[@]}"; do
    "$py" -m llmserve.cli bench-serving --backend router --address "127.0.0.1:$r" --model "$model" \
        --wait-for-server 300 --dataset random --random-input-len 128 --random-output-len 128 \
        --random-range-ratio 1 --num-prompts 64 --max-concurrency "$c" --warmup-requests 0 > "$out/bench_c$c.txt" 2>&1
    read -r rt rn re _ <<< "$(scrape "$rm")"; read -r wt wn we _ <<< "$(scrape "$wm")"
    # Cumulative counters: subtract the previous level's.
    "$py" -c "
rt, rn, re, wt, wn, we = $rt, $rn, $re, $wt, $wn, $we
prev = [float(x) for x in '${prev:-0 0 0 0 0 0}'.split()]
d = [a - b for a, b in zip((rt, rn, re, wt, wn, we), prev)]
print(f'c$c: {d[1]:.0f} requests; router adds TTFT {1e3 * (d[0] - d[3]) / d[1]:+.1f} ms, E2E {1e3 * (d[2] - d[5]) / d[1]:+.1f} ms '
      f'(mean TTFT router {1e3 * d[0] / d[1]:.0f} ms, worker {1e3 * d[3] / d[4]:.0f} ms)')"
    prev="$rt $rn $re $wt $wn $we"
    grep -E "Output token throughput|Median TTFT" "$out/bench_c$c.txt" | sed "s/^/c$c: /"
done
echo "logs in $out"
