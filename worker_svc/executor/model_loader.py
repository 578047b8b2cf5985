"""Stream checkpoint tensors from safetensors files into a materialised model, shard by shard.

Every tensor is opened lazily (``get_slice``) and handed to the ``weight_loader`` of the module owning
its parameter, which reads only this rank's slice (plain modules get a full, shape-checked copy).
Missing, unexpected-but-needed and mis-shaped tensors fail naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import structlog
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from worker_svc.layers.linear import ShapeMismatchError, SliceableTensor

log = structlog.get_logger(__name__)

# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Show a progress bar when a checkpoint is at least this large.
_PROGRESS_MIN_BYTES = 256 * 1024 * 1024


class CheckpointError(ValueError):
    pass


# (fused parameter, checkpoint name fragment, shard id), e.g. ("qkv_proj", "q_proj", "q").
StackedParams = tuple[tuple[str, str, object], ...]


@runtime_checkable
class FusedCheckpoint(Protocol):
    """A model whose fused parameters load from several checkpoint tensors."""

    stacked_params: StackedParams


@runtime_checkable
class ShardLoader(Protocol):
    """A module that reads its own (tensor-parallel) slice of a checkpoint tensor."""

    def weight_loader(self, param: nn.Parameter, source: SliceableTensor, shard_id: object) -> None: ...


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {model_dir}")
    return files


def _target(name: str, stacked: StackedParams) -> tuple[str, object]:
    for fused, fragment, shard_id in stacked:
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard_id
    return name, None


def _expected_names(params: dict[str, nn.Parameter], stacked: StackedParams) -> set[str]:
    names: set[str] = set()
    for name in params:
        fragments = [frag for fused, frag, _ in stacked if f".{fused}." in name]
        if fragments:
            fused = next(f for f, _, _ in stacked if f".{f}." in name)
            names.update(name.replace(f".{fused}.", f".{frag}.") for frag in fragments)
        else:
            names.add(name)
    return names


def _copy_whole(param: nn.Parameter, source, shard_id: object = None) -> None:
    shape = tuple(source.get_shape())
    if shape != tuple(param.shape):
        raise ShapeMismatchError(f"expected {tuple(param.shape)}, got {shape}")
    param.data.copy_(source[:])


def load_checkpoint(
    model: nn.Module, model_dir: str | Path, show_progress: bool | None = None, tied_embeddings: bool = False
) -> None:
    """``tied_embeddings``: the LM head shares the embedding, so a checkpoint's ``lm_head.weight`` is
    an extra copy to skip."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    stacked = model.stacked_params if isinstance(model, FusedCheckpoint) else ()
    params = dict(model.named_parameters())  # tied weights appear once
    expected = _expected_names(params, stacked)
    total_bytes = sum(f.stat().st_size for f in files)
    if show_progress is None:
        show_progress = total_bytes >= _PROGRESS_MIN_BYTES or len(files) > 1
    seen: set[str] = set()
    bar = tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not show_progress)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                param_name, shard_id = _target(name, stacked)
                if param_name not in params:
                    if name == "lm_head.weight" and tied_embeddings:
                        continue  # tied checkpoints may still carry a copy of the embedding
                    log.warning("checkpoint tensor has no parameter; ignored", tensor=name)
                    continue
                module_name, _, attr = param_name.rpartition(".")
                module = model.get_submodule(module_name)
                loader = module.weight_loader if isinstance(module, ShardLoader) else _copy_whole
                try:
                    loader(params[param_name], handle.get_slice(name), shard_id)
                except ShapeMismatchError as exc:
                    raise CheckpointError(f"tensor {name!r} in {path.name} has the wrong shape: {exc}") from None
                seen.add(name)
                bar.update(1)
    bar.close()
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise CheckpointError(f"checkpoint in {model_dir} is missing {len(missing)} tensor(s): {shown}")
