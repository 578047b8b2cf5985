#!/usr/bin/env bash
# The two-batch-overlap check for a machine with CUDA GPUs, one command, under 10 minutes:
#   1. the HF oracle on the device (bench-one-batch --correct, fp32, overlap on: every step of 2+
#      requests is split, so CUDA streams and events of the split path run), for the Llama model and
#      a tiny DeepSeek-V2 (MLA; on CUDA its MoE experts run as grouped GEMMs with no host sync);
#   2. TP=1 decode/prefill timing with overlap off and on;
#   3. with two or more GPUs: TP=2 over NCCL, overlap off and on, with --profile-collectives.
#
#   benchmarks/gpu/tbo_check.sh [MODEL]          # default: a generated bench-preset Llama
#
# DEVICE=cpu runs the same commands on the CPU (what tests/unit/test_gpu_check_script.py does, with
# a tiny model and TBO_QUICK=1 for small sizes). Output: the commands' own reports.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py="${PYTHON:-$root/.venv/bin/python}"
device=${DEVICE:-cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=${1:-}
if [ -z "$model" ]; then
    model="$work/bench"
    "$py" -m llmserve.cli make-model --arch llama --preset "${TBO_PRESET:-bench}" --out "$model" >/dev/null
fi
gpus=0
if [ "$device" = cuda ]; then
    gpus=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    [ "$gpus" -ge 1 ] || { echo "no CUDA device visible (DEVICE=cpu runs the CPU parts)"; exit 2; }
fi
if [ "${TBO_QUICK:-0}" = 1 ]; then sizes=(--batch-size 2 4 --input-len 16 --output-len 4); else
    # 128 rows exceed the default --max-running-requests (64): the engine must be told, or the run fails.
    sizes=(--batch-size 8 32 128 --input-len 128 --output-len 16 --max-running-requests 128); fi
bench=("$py" -m llmserve.cli bench-one-batch --model "$model" --device "$device")
echo "== device $device, GPUs $gpus, model $model"
echo "== 1. HF oracle with two-batch overlap on (fp32)"
"${bench[@]}" --dtype float32 --correct --output-len 8 --enable-two-batch-overlap --tbo-min-tokens 2
"$py" -m llmserve.cli make-model --arch deepseek_v2 --preset tiny --out "$work/deepseek" >/dev/null
"$py" -m llmserve.cli bench-one-batch --model "$work/deepseek" --device "$device" --dtype float32 --correct \
    --output-len 8 --enable-two-batch-overlap --tbo-min-tokens 2
for overlap in off on; do
    flags=(); [ "$overlap" = on ] && flags=(--enable-two-batch-overlap --tbo-min-tokens 2)
    echo "== 2. TP=1, overlap $overlap"
    "${bench[@]}" --dtype bfloat16 "${sizes[@]}" "${flags[@]}" | grep -E "^(Prefill|Decode)\.  ?median|^Prefill\."
done
if [ "$gpus" -ge 2 ]; then
    for overlap in off on; do
        flags=(); [ "$overlap" = on ] && flags=(--enable-two-batch-overlap --tbo-min-tokens 2)
        echo "== 3. TP=2 (NCCL), overlap $overlap"
        "${bench[@]}" --dtype bfloat16 --tp 2 --profile-collectives "${sizes[@]}" "${flags[@]}" \
            | grep -E "median|^Prefill\.|Collectives"
    done
else
    echo "== 3. TP=2 skipped: $gpus GPU(s)"
fi
