#!/usr/bin/env bash
# Every CUDA check of the project in one command, for a lent GPU machine whose python3 holds a CUDA
# torch (it runs under that image's packages, not this project's pins):
#   0. the machine: nvidia-smi, torch and its CUDA;
#   1. the CUDA tests (tests/unit/test_cuda_graph_runner.py: graph capture and replay against eager);
#   2. benchmarks/gpu/decode_check.sh (HF oracle with CUDA graphs on and off, bs1/bs16 decode timing);
#   3. benchmarks/gpu/tbo_check.sh (HF oracle with two-batch overlap on CUDA streams, TP=1 timing).
# Each part runs under its own time limit, so one that hangs does not take the others with it; each
# part's output goes to LOGS/NAME.log (LOGS defaults to $OUT, the folder a device call brings back, else
# a temporary folder).
#
#   benchmarks/gpu/all_checks.sh                          # PARTS="decode_check tbo_check": only those
#
# Packages the image lacks travel as wheels in .whl/ (or WHEELS; see docs/benchmarks.md, "CUDA checks"):
# they are installed into /tmp/site first.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
logs=${LOGS:-${OUT:-$(mktemp -d)}}
mkdir -p "$logs"
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}

status=0
# part NAME SECONDS COMMAND...: run it under a time limit, its output to the console and LOGS/NAME.log;
# PARTS="a b" runs only those (a rerun after a fix).
part() {
    local name=$1 limit=$2 start rc
    shift 2
    [[ " ${PARTS:-machine cuda_tests decode_check tbo_check} " == *" $name "* ]] || return 0
    echo "==== $name (limit ${limit}s)"
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log"
    rc=${PIPESTATUS[0]}
    echo "==== $name: rc $rc in $(($(date +%s) - start)) s"
    [ "$rc" = 0 ] || status=1
}

part machine 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc;
    "$PYTHON" -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
        torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"'
part cuda_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/unit/test_cuda_graph_runner.py
part decode_check 240 benchmarks/gpu/decode_check.sh
part tbo_check 150 benchmarks/gpu/tbo_check.sh
exit $status
