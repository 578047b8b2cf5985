"""Convert a Llama GGUF file into an HF model folder this engine (and HF transformers) loads.

transformers' GGUF loader does the work (``GgufConfig(dequantize=True)`` turns the quantized blocks
back into dense tensors and undoes llama.cpp's q/k row permutation); it and ``gguf`` are imported
here only, from the optional ``[models]`` extra, never by a worker at run time. The folder gets
bf16 ``model.safetensors``, config.json, tokenizer.json + tokenizer_config.json + chat_template.jinja,
a generation_config.json whose EOS is the chat's end token, and PROVENANCE.json.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from llmserve.packaged_models.download import FetchError, Progress, sha256_of

PROVENANCE_FILE = "PROVENANCE.json"
SUPPORTED_ARCHITECTURES = ("llama",)


def _require_converter() -> None:
    missing = [m for m in ("transformers", "gguf", "accelerate") if not _installed(m)]
    if missing:
        raise FetchError(f"GGUF conversion needs {', '.join(missing)}: pip install 'llmserve[models]' "
                         f"(the worker itself does not need them)")


def _installed(module: str) -> bool:
    try:
        metadata.version(module)
        return True
    except metadata.PackageNotFoundError:
        return False


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF header's scalar and string fields (token lists left out)."""
    _require_converter()
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise FetchError(f"{path} is not a readable GGUF file ({exc})") from None
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "scores", "token_type")):
            continue
        try:
            out[key] = field.contents()
        except (ValueError, IndexError):
            continue
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress, provenance: dict[str, Any],
                 license_text: str | None = None, keep_gguf: bool = False) -> Path:
    """Write the HF folder for ``gguf_path`` at ``out_dir`` (built beside it, then renamed into place)."""
    meta = gguf_metadata(gguf_path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise FetchError(f"{gguf_path.name}: architecture {arch!r} is not supported "
                         f"(convert-gguf handles {', '.join(SUPPORTED_ARCHITECTURES)})")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _convert_into(gguf_path, partial, progress)
        eos = _fix_generation_config(partial)
        if keep_gguf:
            shutil.copy2(gguf_path, partial / gguf_path.name)
        if license_text:
            (partial / "LICENSE").write_text(license_text, encoding="utf-8")
        record = {
            **provenance,
            "gguf_file": gguf_path.name,
            "gguf_sha256": provenance.get("gguf_sha256") or sha256_of(gguf_path),
            "gguf_name": meta.get("general.name"),
            "gguf_organization": meta.get("general.organization"),
            "license": provenance.get("license") or meta.get("general.license"),
            "weights": "GGUF blocks dequantized to bfloat16 (the quantized values, not the original checkpoint)",
            "eos_token_id": eos,
            "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "converted_with": {p: metadata.version(p) for p in ("llmserve", "transformers", "gguf")},
        }
        (partial / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def _convert_into(gguf_path: Path, folder: Path, progress: Progress) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    transformers.logging.set_verbosity_error()
    # transformers also reads config and tokenizer files lying beside the GGUF (an HF folder holding
    # its own GGUF, say) and mixes them in; a folder with only a link to the file keeps the GGUF the
    # single source.
    with tempfile.TemporaryDirectory(prefix=".gguf-src.", dir=folder.parent) as src_dir:
        name = gguf_path.name
        (Path(src_dir) / name).symlink_to(gguf_path.resolve())
        progress("  reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        progress("  dequantizing the weights to bfloat16")
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16,
                                                     quantization_config=GgufConfig(dequantize=True))
    progress("  writing safetensors, config and tokenizer files")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for path in folder.iterdir():
        path.chmod(0o644)


def _fix_generation_config(folder: Path) -> int | None:
    """generation_config.json's eos_token_id must be the tokenizer's EOS (the chat's end token), so a
    chat stops there; GGUF files carry it as tokenizer.ggml.eos_token_id, which transformers copies."""
    from tokenizer_svc.tokenizer import ModelTokenizer

    tok = ModelTokenizer.from_dir(folder)
    eos = tok.tokenizer.token_to_id(tok.eos_token) if tok.eos_token else None
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
    if eos is not None:
        existing = gen.get("eos_token_id")
        existing = existing if isinstance(existing, list) else ([] if existing is None else [existing])
        gen["eos_token_id"] = list(dict.fromkeys([eos, *existing]))
        gen_path.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    return eos
