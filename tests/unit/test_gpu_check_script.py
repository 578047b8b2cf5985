"""benchmarks/gpu/tbo_check.sh, the prepared GPU check of the two-batch overlap, run here on the CPU
(DEVICE=cpu, tiny model, small sizes): its device selection and flags work, its HF oracle step passes
with overlap on, and it skips the TP=2 part without two GPUs. On a CUDA machine it runs as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc.config.engine_config import EngineConfig

GPU_SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
SCRIPT = GPU_SCRIPTS / "tbo_check.sh"


def test_the_gpu_check_runs_its_cpu_parts() -> None:
    env = {**os.environ, "DEVICE": "cpu", "TBO_QUICK": "1", "TBO_PRESET": "tiny", "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "== device cpu, GPUs 0" in out
    assert out.count("Correctness check: PASSED") == 2  # the Llama and the DeepSeek-V2 oracle
    assert out.count("median latency") >= 4  # TP=1 off and on, two batch sizes each
    assert "== 3. TP=2 skipped: 0 GPU(s)" in out


def test_the_gpu_check_refuses_a_machine_without_cuda() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), "/nonexistent"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device visible" in done.stdout


@pytest.mark.parametrize("name", ["tbo_check.sh", "decode_check.sh"])
def test_the_full_sizes_fit_the_engine_they_ask_for(name: str) -> None:
    """The full sizes run only on a GPU, never here: their largest batch must fit the engine's
    --max-running-requests (regression: tbo_check asked for 128 rows of a 64-row engine and its timing
    part failed on the first H200 it met)."""
    full = re.findall(r"^\s*sizes=\((.*)\); fi$", (GPU_SCRIPTS / name).read_text(), re.MULTILINE)
    assert len(full) == 1
    args = shlex.split(full[0])
    after = args[args.index("--batch-size") + 1:]
    batches = [int(a) for a in after[:next(i for i, a in enumerate(after) if a.startswith("--"))]]
    limit = EngineConfig.max_running_requests  # the field's default
    if "--max-running-requests" in args:
        limit = int(args[args.index("--max-running-requests") + 1])
    assert max(batches) <= limit
