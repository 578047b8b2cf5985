#!/usr/bin/env bash
# The router's own share of TTFT and E2E, paired over the same requests in one run (issue 16, acceptance 4):
# a tokenizer, a worker and a router with Prometheus metrics; `llmserve bench-serving` through the router at
# each concurrency; the router's and the worker's own histograms (time_to_first_token_seconds,
# e2e_request_latency_seconds) are scraped after each run, and their mean difference is what the router adds
# (tokenization, the worker hop, relaying and detokenizing the first token). Unlike two end-to-end runs
# compared, the run-to-run spread cancels. That difference also holds the worker's own gRPC intake and
# first send, which a client calling the worker directly pays as well: an upper bound on the router's share.
#
# Then (SPLIT_ROUNDS rounds, default 2) each level again as two clients at once on the same worker: half
# the streams through the router, half straight to the worker, 64 requests each, the same prompts, started
# at one wall-clock time (--start-at). Both halves share every engine step: their throughput ratio is the
# router's cost at the same load. Their TTFTs are not comparable as they are: equal-length requests run in
# waves, and the half whose first wave reaches the worker first keeps being prefilled first (60-800 ms,
# either way round). So each request's TTFT as its client saw it is taken minus the worker's own TTFT of
# that request (its log), which leaves the request's transport alone; the router's share is the
# difference of the two paths' medians (and means) of it, what a client pays for the router beyond what it
# pays calling the worker itself. Which half goes 20 ms ahead alternates by round.
# Last, each level's requests of all rounds pooled: one median per path over all of them, the figure to
# quote (a round's own medians swing with which half led).
# And the router path's part of it split four ways from the router's and the worker's logs: the client <->
# router hops (gRPC intake and delivery), planning, the hop to the worker, the first token's way back.
#
#   benchmarks/router_overhead.sh MODEL [CONCURRENCY ...]   (default 16 64)
# SPLIT_ONLY=1: the split rounds alone. ROUTER_FLAGS: extra router flags (e.g. "--detokenize service").
# WORKER_FLAGS: extra worker flags (e.g. "--compute-nice 10").
set -euo pipefail
model=$(realpath "${1:?usage: benchmarks/router_overhead.sh MODEL [CONCURRENCY ...]}"); shift
levels=(16 64); [ $# -gt 0 ] && levels=("$@")
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
out=${OUT_DIR:-$(mktemp -d)}
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
# Every run below: 64 requests of exactly 128 tokens in and out.
workload=(--model "$model" --wait-for-server 300 --dataset random --random-input-len 128 --random-output-len 128
          --random-range-ratio 1 --num-prompts 64 --warmup-requests 0)
hist_levels=("${levels[@]}")
if [ "${SPLIT_ONLY:-0}" = 1 ]; then  # no histogram runs: only wait for the services (and warm them)
    hist_levels=()
    "$py" -m llmserve.cli bench-serving --backend router --address "127.0.0.1:$r" "${workload[@]}" --num-prompts 8 \
        --max-concurrency 8 > "$out/warmup.txt" 2>&1
fi
for c in "${hist_levels[@]}"; do
    "$py" -m llmserve.cli bench-serving --backend router --address "127.0.0.1:$r" "${workload[@]}" \
        --max-concurrency "$c" > "$out/bench_c$c.txt" 2>&1
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
# split_report ROUND C ORDER START: the two halves' reports, and per request its TTFT as the client saw it
# minus the worker's own TTFT for it (the worker's "generate finished" line, stamped after START, the round's
# start time; the client labels each request bench-N: the direct client's is the worker's request_id, the
# router's reaches the worker as client_request_id). That difference is the request's transport (intake,
# sends, relays) with its wait for the engine taken out; the router's cost is the router path's median (and
# mean) of it minus the direct path's, which neither the order of the waves nor the engine's step time moves.
split_report() {
    "$py" - "$out" "$@" <<'PY'
import datetime, json, re, statistics, sys
out, rnd, c, order, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
def report(target):
    run = json.loads(open(f"{out}/split_{target}_c{c}_r{rnd}.jsonl").read())
    client = {r["request_id"]: r["ttft_ms"] for r in run["requests"]}
    return run["output_throughput"], run["median_ttft_ms"], run["mean_ttft_ms"], client
def stamped(line):  # a log line's wall time (s) and its key=value fields
    stamp = datetime.datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")).timestamp()
    return stamp, dict(re.findall(r" (\w+)=(\S+)", line))
own = {"router": {}, "worker": {}}  # path -> the client's label -> the worker's TTFT (ms)
worker_received = {}  # the client's label -> wall time the worker took a router-path request
for line in open(f"{out}/worker.log"):
    if "generate finished" not in line:
        continue
    stamp, fields = stamped(line)
    if stamp < start or "ttft_s" not in fields:
        continue
    if fields["request_id"].startswith("rt-"):
        own["router"][fields["client_request_id"]] = 1e3 * float(fields["ttft_s"])
        worker_received[fields["client_request_id"]] = stamp - float(fields["duration_s"])
    else:
        own["worker"][fields["request_id"]] = 1e3 * float(fields["ttft_s"])
routed, router_done = {}, {}  # from the router's log: when it sent a request on; its received time and TTFT
for line in open(f"{out}/router.log"):
    if "generate routed" not in line and "generate finished" not in line:
        continue
    stamp, fields = stamped(line)
    # The half that leads starts 20 ms before `start`; the round before ended seconds earlier.
    if stamp < start - 1.0 or not fields.get("request_id", "").startswith("bench-"):
        continue
    if "generate routed" in line:
        routed.setdefault(fields["request_id"], stamp)
    elif "ttft_s" in fields:
        router_done[fields["request_id"]] = (stamp - float(fields["duration_s"]), 1e3 * float(fields["ttft_s"]))
# Every request of the round and none of another's, or the figures below are void.
assert len(own["router"]) == len(own["worker"]) == 64, {k: len(v) for k, v in own.items()}
(rtok, rmed, rmean, rclient), (wtok, wmed, wmean, wclient) = report("router"), report("worker")
def transport(client, path):  # per request: client TTFT minus the worker's own
    return [client[rid] - own[path][rid] for rid in client]
r_path, d_path = transport(rclient, "router"), transport(wclient, "worker")
r_p50, d_p50 = statistics.median(r_path), statistics.median(d_path)
r_mean, d_mean = statistics.mean(r_path), statistics.mean(d_path)
print(f"split c{c} round {rnd} ({c // 2} + {c // 2} streams, {order} first): router / direct output tok/s "
      f"{rtok:.1f} / {wtok:.1f} ({rtok / wtok:.3f}x); client TTFT p50 {rmed:.1f} / {wmed:.1f} ms, mean {rmean:.1f} / "
      f"{wmean:.1f}; per request, client minus worker TTFT, router path / direct: p50 {r_p50:.1f} / {d_p50:.1f} ms, "
      f"mean {r_mean:.1f} / {d_mean:.1f} ms: the router adds {r_p50 - d_p50:+.1f} ms (p50), {r_mean - d_mean:+.1f} ms (mean)")
# The router path's TTFT beyond the worker's own, per request, in four parts: the client <-> router hops
# (gRPC intake and delivery), planning (received -> sent on), the hop to the worker, and the first token's
# way back through the router (the rest of the router's TTFT beyond the worker's).
parts = {"client <-> router": [], "planning": [], "hop to the worker": [], "first token back": []}
for rid, client_ttft in rclient.items():
    received, router_ttft = router_done[rid]
    planning, hop = 1e3 * (routed[rid] - received), 1e3 * (worker_received[rid] - routed[rid])
    parts["client <-> router"].append(client_ttft - router_ttft)
    parts["planning"].append(planning)
    parts["hop to the worker"].append(hop)
    parts["first token back"].append(router_ttft - own["router"][rid] - planning - hop)
with open(f"{out}/transport_c{c}.jsonl", "a") as f:  # for pooled_report
    f.write(json.dumps({"round": int(rnd), "router": r_path, "direct": d_path, "parts": parts}) + "\n")
PY
}
# pooled_report C: every round's requests at that level together, one p50 (and mean) per path over all of them:
# the rounds' own p50s swing with which half led, and the median of a few of them is a coarse estimate.
pooled_report() {
    "$py" - "$out/transport_c$1.jsonl" "$1" <<'PY'
import json, statistics, sys
rounds = [json.loads(line) for line in open(sys.argv[1])]
r = [x for rd in rounds for x in rd["router"]]
d = [x for rd in rounds for x in rd["direct"]]
print(f"split c{sys.argv[2]}, all {len(rounds)} rounds pooled ({len(r)} + {len(d)} requests): per request, client minus "
      f"worker TTFT, router path / direct: p50 {statistics.median(r):.1f} / {statistics.median(d):.1f} ms, mean "
      f"{statistics.mean(r):.1f} / {statistics.mean(d):.1f} ms: the router adds {statistics.median(r) - statistics.median(d):+.1f} "
      f"ms (p50), {statistics.mean(r) - statistics.mean(d):+.1f} ms (mean)")
def p90(v):
    return sorted(v)[int(0.9 * (len(v) - 1))]
parts = {name: [x for rd in rounds for x in rd["parts"][name]] for name in rounds[0]["parts"]}
print(f"split c{sys.argv[2]}, router path, pooled, p50 / p90 ms: "
      + "; ".join(f"{name} {statistics.median(v):.1f} / {p90(v):.1f}" for name, v in parts.items()))
PY
}
for round in $(seq "${SPLIT_ROUNDS:-2}"); do
    for c in "${levels[@]}"; do
        half=$((c / 2))
        clients=()
        order="router worker"; [ $((round % 2)) = 0 ] && order="worker router"
        start=$("$py" -c "import time; print(time.time() + 8)")  # both clients connected and warmed up by then
        lead=0.02
        for target in $order; do
            addr=127.0.0.1:$r; [ "$target" = worker ] && addr=127.0.0.1:$w
            "$py" -m llmserve.cli bench-serving --backend "$target" --address "$addr" "${workload[@]}" \
                --max-concurrency "$half" --seed "$round" --start-at "$("$py" -c "print($start - $lead)")" \
                --output-file "$out/split_${target}_c${c}_r$round.jsonl" --output-details > "$out/split_${target}_c${c}_r$round.txt" 2>&1 &
            clients+=("$!")
            lead=0
        done
        wait "${clients[@]}"
        split_report "$round" "$c" "${order%% *}" "$start"
    done
done
if [ "${SPLIT_ROUNDS:-2}" -gt 0 ]; then
    for c in "${levels[@]}"; do pooled_report "$c"; done
fi
echo "logs in $out"
