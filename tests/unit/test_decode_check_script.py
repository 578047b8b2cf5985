"""benchmarks/gpu/decode_check.sh, the prepared GPU check of CUDA-graph decode, run here on the CPU
(DEVICE=cpu, tiny model, small sizes): its device selection and flags work, its HF oracle steps pass with
graphs on (resolved off on the CPU, as its log must say) and off with the same greedy tokens, and it
prints the timing table. On a
CUDA machine it runs as written and fails unless the graphs were captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "decode_check.sh"


@pytest.mark.slow
def test_the_decode_check_runs_its_cpu_parts() -> None:
    env = {**os.environ, "DEVICE": "cpu", "DECODE_QUICK": "1", "DECODE_PRESET": "tiny", "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "== device cpu (sm none)" in out
    assert out.count("Correctness check: PASSED") == 5  # Llama fp32 and DeepSeek-V2 bf16 on/off, DeepSeek-V2 fp32
    assert out.count("greedy tokens, graphs on vs off: same") == 2
    assert out.count("device cpu: CUDA graphs need CUDA") == 7  # every run logged why it ran eagerly
    assert out.count("median latency") == 6  # the warm-up, bs 1 and bs 4; graphs off and on
    table = out[out.index("== decode step, median ms"):].splitlines()
    assert [row.split()[0] for row in table[1:3]] == ["1", "4"] and all(row.endswith("x") for row in table[1:3])


def test_the_decode_check_refuses_a_machine_without_cuda() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), "/nonexistent"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device visible" in done.stdout
