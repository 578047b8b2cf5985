"""Writing a state dict as one model.safetensors or as K shards plus model.safetensors.index.json."""

import json
from pathlib import Path

import torch
from safetensors.torch import save

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_METADATA = {"format": "pt"}


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _split_by_bytes(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Contiguous groups of about equal bytes, none empty (module order kept, as HF shards do)."""
    total = sum(sizes)
    groups: list[list[str]] = [[]]
    done = 0
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        left = len(names) - i  # tensors not yet placed, this one included
        new_shards_needed = shards - len(groups)
        if groups[-1] and new_shards_needed > 0 and (
                done >= total * len(groups) / shards or left <= new_shards_needed):
            groups.append([])
        groups[-1].append(name)
        done += size
    return groups


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # Written through Python rather than safetensors.save_file, which creates files mode 0600:
    # containers running as another user must still be able to read the weights.
    path.write_bytes(save(tensors, metadata=_METADATA))


def _remove_stale(out_dir: Path) -> None:
    # A leftover model.safetensors next to a new index (or the reverse) would make loaders read old
    # weights: HF prefers the single file when both exist.
    for p in out_dir.glob("model*.safetensors"):
        p.unlink()
    (out_dir / INDEX_FILE).unlink(missing_ok=True)


def save_weights(tensors: dict[str, torch.Tensor], out_dir: Path, shards: int = 1) -> list[Path]:
    """Write tensors (in their given order) and return the files written."""
    if shards < 1 or shards > len(tensors):
        raise ValueError(f"shards must be in 1..{len(tensors)}, got {shards}")
    _remove_stale(out_dir)
    if shards == 1:
        path = out_dir / SINGLE_FILE
        _save_file(tensors, path)
        return [path]
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    weight_map: dict[str, str] = {}
    written: list[Path] = []
    for i, group in enumerate(_split_by_bytes(names, sizes, shards), start=1):
        fname = shard_file_name(i, shards)
        _save_file({n: tensors[n] for n in group}, out_dir / fname)
        weight_map.update({n: fname for n in group})
        written.append(out_dir / fname)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return written + [out_dir / INDEX_FILE]
