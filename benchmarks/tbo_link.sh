#!/usr/bin/env bash
# Two-batch overlap across a modelled link: a TP=2 group over gloo inside a network namespace of its
# own whose loopback is rate-shaped with tbf (netem is not in this kernel; tbf is), overlap off and on,
# at each rate. All traffic stays on 127.0.0.1 inside the namespace, which is removed afterwards
# (also on error or interrupt). Needs root (ip netns).
#
#   benchmarks/tbo_link.sh MODEL [RATE ...]          # default rates: 2gbit 10gbit
#
# Prints one markdown row per rate, overlap off and on (tp_scaling.py's table, --profile).
set -euo pipefail
model=${1:?usage: benchmarks/tbo_link.sh MODEL [RATE ...]}
shift
if [ $# -gt 0 ]; then rates=("$@"); else rates=(2gbit 10gbit); fi
root=$(cd "$(dirname "$0")/.." && pwd)
ns="llmserve-tbo-$$"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
ip netns add "$ns"
ip -n "$ns" link set lo up
for rate in "${rates[@]}"; do
    ip netns exec "$ns" tc qdisc replace dev lo root tbf rate "$rate" burst 256kb latency 5ms
    echo "### link $rate (tbf on the namespace's loopback)"
    ip netns exec "$ns" timeout 1200 "$root/.venv/bin/python" "$root/benchmarks/tp_scaling.py" "$model" \
        --rounds "${TBO_ROUNDS:-2}" --batch-size ${TBO_BATCH:-8 32} --output-len 8 --profile \
        --configs "TP=2 gloo, 1 thread/rank" "TP=2 gloo + overlap"
done
