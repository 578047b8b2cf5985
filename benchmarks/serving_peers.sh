#!/usr/bin/env bash
# Serving against vLLM-CPU with vLLM's own client (issue 16, acceptance 2-4), one sitting:
#   1. vLLM's OpenAI server and our worker behind the smg gateway, driven by vLLM's bench_serve:
#      random 128 in / 128 out at concurrency 16 and 64, then prefix_repetition (4 prefixes of 512
#      tokens, suffixes of 64, 32 out, 64 requests, concurrency 8), ours with the radix cache on and off;
#   2. our router against the worker directly (llmserve bench-serving, interleaved, two rounds), concurrency
#      16 and 64, radix cache off (random prompts share nothing anyway).
# Output: each client's own report, in $OUT (default a temp dir), then a summary.
#
#   benchmarks/serving_peers.sh MODEL VLLM_PYTHON [OUT]
#
# PARTS (default "vllm ours direct") runs only the parts named: vLLM's server, ours behind smg, router vs worker;
# "vllm_nocache" adds vLLM with its prefix cache off on the shared-prefix workload (its own on / off ratio).
# OURS_FLAGS: extra worker flags for part 2 (e.g. "--enable-torch-compile"). ROUNDS: rounds of part 3 (default 2).
# TRACE_STEPS=1: each of our workers in part 2 writes its step trace (--trace-steps) to $OUT/steps_TAG.jsonl.
# ROUTER_FLAGS: extra router flags for part 3 (e.g. "--detokenize service"). PREFIX_ROUNDS: rounds of the
# shared-prefix workload with our cache on and off (default 2; ABBA order).
set -euo pipefail
parts=" ${PARTS:-vllm ours direct} "
model=$(realpath "${1:?usage: benchmarks/serving_peers.sh MODEL VLLM_PYTHON [OUT]}")
vllm_py=${2:?vLLM venv python}
out=${3:-$(mktemp -d)}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
smg=$root/.venv/bin/smg
bench_serve=$root/benchmarks/peer_vllm_bench_serve.py  # vLLM's benchmarks.serve, run by the vLLM venv
port() { "$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_http() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

client() {  # client NAME PORT ARGS...: vLLM's bench_serve against an OpenAI endpoint
    local name=$1 p=$2; shift 2
    "$vllm_py" "$bench_serve" --backend openai --base-url "http://127.0.0.1:$p" --endpoint /v1/completions \
        --model m --tokenizer "$model" --seed 0 "$@" > "$out/$name.txt" 2>&1 || echo "client $name failed" >&2
    grep -E "Output token throughput|Median TTFT|Median TPOT|Successful requests" "$out/$name.txt" | sed "s/^/$name: /" || true
}
random_args=(--dataset-name random --random-input-len 128 --random-output-len 128 --ignore-eos --num-prompts 64)
prefix_args=(--dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64
             --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 32 --num-prompts 64 --max-concurrency 8)

# --- vLLM-CPU (started once; minutes) ---
vllm_server() {  # vllm_server LOG EXTRA_FLAGS...: start vLLM's OpenAI server, set vport / vllm_pid
    local log=$1; shift
    vport=$(port)
    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 "$vllm_py" -m vllm.entrypoints.openai.api_server \
        --model "$model" --dtype bfloat16 --max-model-len 1024 --max-num-seqs 64 --host 127.0.0.1 --port "$vport" \
        --served-model-name m "$@" > "$out/$log" 2>&1 &
    vllm_pid=$!; pids+=("$vllm_pid")
    wait_http "$vport" || { echo "vLLM server did not come up (log: $out/$log)"; exit 1; }
}
if [[ $parts == *" vllm "* ]]; then
vllm_server vllm_server.log
for c in 16 64; do client "vllm_random_c$c" "$vport" "${random_args[@]}" --max-concurrency "$c"; done
client vllm_prefix "$vport" "${prefix_args[@]}"
kill "$vllm_pid"; wait "$vllm_pid" 2>/dev/null || true
fi
# vLLM's own cache on / off on the shared-prefix workload (part "vllm_nocache", after "vllm"): the same ratio
# acceptance 2 asks of us, for the peer on the same host.
if [[ $parts == *" vllm_nocache "* ]]; then
vllm_server vllm_server_nocache.log --no-enable-prefix-caching
client vllm_prefix_nocache "$vport" "${prefix_args[@]}"
kill "$vllm_pid"; wait "$vllm_pid" 2>/dev/null || true
fi

# --- ours: worker (+ smg), radix cache on, then off for the prefix workload ---
ours() {  # ours TAG EXTRA_WORKER_FLAGS...: start worker + smg, run the clients, stop
    local tag=$1; shift
    local wport gport
    wport=$(port); gport=$(port)
    "$py" -m llmserve.cli worker --model "$model" --dtype bfloat16 --port "$wport" --served-model-name m \
        --max-running-requests 64 ${OURS_FLAGS:-} ${TRACE_STEPS:+--trace-steps "$out/steps_$tag.jsonl"} "$@" \
        > "$out/worker_$tag.log" 2>&1 &
    local wpid=$!; pids+=("$wpid")
    "$smg" launch --host 127.0.0.1 --port "$gport" --worker-urls "grpc://127.0.0.1:$wport" --policy round_robin \
        --tokenizer-path "$model" --prometheus-host 127.0.0.1 --prometheus-port "$(port)" > "$out/smg_$tag.log" 2>&1 &
    local gpid=$!; pids+=("$gpid")
    wait_http "$gport" || { echo "smg/worker did not come up ($out/worker_$tag.log)"; exit 1; }
    if [ "$tag" = cache ]; then
        for c in 16 64; do client "ours_random_c$c" "$gport" "${random_args[@]}" --max-concurrency "$c"; done
    fi
    client "ours_prefix_$tag" "$gport" "${prefix_args[@]}"
    kill "$gpid" "$wpid"; wait "$gpid" "$wpid" 2>/dev/null || true
}
if [[ $parts == *" ours "* ]]; then
    ours cache
    ours nocache --disable-radix-cache
    # More rounds of the shared-prefix workload, cache on and off in ABBA order: the host's speed drifts
    # within a sitting, and one run of each put a slow minute on one side only.
    for round in $(seq 2 "${PREFIX_ROUNDS:-2}"); do
        if (( round % 2 == 0 )); then
            ours "nocache_r$round" --disable-radix-cache; ours "cache_r$round"
        else
            ours "cache_r$round"; ours "nocache_r$round" --disable-radix-cache
        fi
    done
    "$py" - "$out" <<'PY'
import pathlib, re, statistics, sys
p50 = {}  # (round, "cache" | "nocache") -> client's TTFT p50, ms
for path in pathlib.Path(sys.argv[1]).glob("ours_prefix_*.txt"):
    name = re.fullmatch(r"ours_prefix_(cache|nocache)(?:_r(\d+))?\.txt", path.name)
    ttft = re.search(r"Median TTFT \(ms\):\s+([\d.]+)", path.read_text())
    if name and ttft:
        p50[(int(name.group(2) or 1), name.group(1))] = float(ttft.group(1))
rounds = sorted({r for r, _ in p50 if (r, "cache") in p50 and (r, "nocache") in p50})
for r in rounds:
    on, off = p50[(r, "cache")], p50[(r, "nocache")]
    print(f"prefix TTFT p50, round {r}: cache on {on:.1f} ms, off {off:.1f} ms: {off / on:.2f}x")
if rounds:
    on = statistics.median(p50[(r, "cache")] for r in rounds)
    off = statistics.median(p50[(r, "nocache")] for r in rounds)
    print(f"prefix TTFT p50, median of {len(rounds)} rounds: cache on {on:.1f} ms, off {off:.1f} ms: {off / on:.2f}x")
PY
fi
[[ $parts == *" direct "* ]] || { echo "reports in $out"; exit 0; }

# --- router against the worker directly (llmserve bench-serving, interleaved), the same prompts ---
wport=$(port); tport=$(port); rport=$(port)
"$py" -m llmserve.cli worker --model "$model" --dtype bfloat16 --port "$wport" --max-running-requests 64 \
    --disable-radix-cache > "$out/worker_direct.log" 2>&1 &
pids+=("$!")
"$py" -m llmserve.cli tokenizer --model "$model" --port "$tport" > "$out/tokenizer.log" 2>&1 &
pids+=("$!")
"$py" -m llmserve.cli router --tokenizer "127.0.0.1:$tport" --workers "127.0.0.1:$wport" --port "$rport" \
    --max-concurrent-requests 256 ${ROUTER_FLAGS:-} > "$out/router.log" 2>&1 &
pids+=("$!")
for c in 16 64; do
    for round in $(seq "${ROUNDS:-2}"); do
        for target in router worker; do
            addr=127.0.0.1:$rport; [ "$target" = worker ] && addr=127.0.0.1:$wport
            name=ours_${target}_c${c}_r$round
            "$py" -m llmserve.cli bench-serving --backend "$target" --address "$addr" --model "$model" \
                --wait-for-server 300 --dataset random --random-input-len 128 --random-output-len 128 \
                --random-range-ratio 1 --num-prompts 64 --max-concurrency "$c" --output-file "$out/$name.jsonl" \
                > "$out/$name.txt" 2>&1 || echo "bench-serving $name failed" >&2
            grep -E "Output token throughput|Median TTFT" "$out/$name.txt" | sed "s/^/$name: /" || true
        done
    done
done
echo "reports in $out"
