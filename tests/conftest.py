"""Session-wide fixtures: tiny HF-format models are generated once and shared by every test."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmserve.modelgen import make_model

ModelFactory = Callable[..., Path]


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
