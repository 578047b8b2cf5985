"""Build and load this project's AVX2 CPU kernels (``worker_svc/kernels/csrc/*.cpp``) on first use:

- quant_linear_avx2.cpp, quant_linear_avx512.cpp: quantized linears (worker_svc/executor/quantize.py);
- decode_attention_avx2.cpp: one-token attention over the paged KV pool (attention/torch_native.py), AVX-512 path too;
- rotary_avx2.cpp: rotate-half rotary for q and k (layers/rotary.py);
- bf16_linear_avx512.cpp, bf16_linear_amx.cpp: bf16 linears on packed weights (kernels/bf16_linear.py);
- rms_norm_avx2.cpp: RMSNorm and residual-add + RMSNorm for bf16/fp16 (layers/norm.py);
- sampling_race.cpp: the sampler's Gumbel race with its Philox noise, fused (sampling/sampler.py);
- sampling_truncation.cpp: top-k / top-p / min-p as one logit threshold per row (sampling/sampler.py).

The library is compiled by ``torch.utils.cpp_extension`` into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) the first time a process asks for
it (about a minute on 2 cores; ``scripts/bootstrap.sh`` does it at install); later processes find
the built library and only load it. Builds are serialized by a lock file in that directory, so the
ranks of a worker group starting together compile once. The sources are built from a copy in the
cache named by their digest, and the library's name carries it too: checkouts of the same sources
at different paths share one build (torch rebuilds when a source path changes), and checkouts of
different sources never overwrite each other's.

``load()`` returns None, with the reason logged, when the host cannot use the kernels (not x86-64
with AVX2, no C++ compiler, build error); callers then keep the torch/aten paths.

    python -m worker_svc.kernels.cpu_ext    # build now (exit status 1 if it cannot be built)
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import structlog
import torch

from worker_svc.kernels import fake_ops

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]

log = structlog.get_logger(__name__)


def host_supports_avx2() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2",
        "AVX512",
    )


@functools.cache
def load() -> object | None:
    """``torch.ops.llmserve_cpu`` with the kernels registered, or None where they cannot run."""
    if not host_supports_avx2():
        log.info("cpu_ext.unavailable", reason=f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
        return None
    from torch.utils import cpp_extension

    # The digest of every file in csrc/ (headers too) names the build: a changed file is a new library.
    digest = hashlib.sha1(b"".join(path.read_bytes() for path in sorted(CSRC.iterdir()))).hexdigest()[:16]
    start = time.perf_counter()
    try:
        sources = _sources_in_cache(Path(cpp_extension.get_default_build_root()), digest)
        cpp_extension.load(
            name=f"llmserve_cpu_avx2_{digest}",
            sources=[str(path) for path in sources],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # compiler missing or failing: the torch paths still work
        log.warning("cpu_ext.build_failed", error=str(exc).splitlines()[-1] if str(exc) else repr(exc))
        return None
    fake_ops.register(torch.ops.llmserve_cpu)  # so torch.compile can trace steps that call them
    log.info("cpu_ext.loaded", seconds=round(time.perf_counter() - start, 2))
    return torch.ops.llmserve_cpu


def _sources_in_cache(build_root: Path, digest: str) -> list[Path]:
    """The .cpp files, copied once to ``<build root>/llmserve_csrc/<digest>`` (a path that does not
    depend on where this checkout lives); a concurrent copier's finished folder wins the rename."""
    folder = build_root / "llmserve_csrc" / digest
    if not folder.is_dir():
        staging = folder.parent / f".{digest}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(CSRC, staging)
        try:
            staging.rename(folder)
        except OSError:  # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    return sorted(folder.glob("*.cpp"))


if __name__ == "__main__":
    sys.exit(0 if load() is not None else 1)
