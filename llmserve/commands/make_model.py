"""The `llmserve make-model` subcommand."""

import argparse
import sys
import time

from llmserve.commands.engine_args import json_object
from llmserve.modelgen.presets import ARCHS, PLANNED_ARCHS, PRESETS


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a deterministic random HF-format model folder",
        description="Write config.json, safetensors weights and a trained BPE tokenizer. "
        "Same arguments give byte-identical files.",
    )
    p.add_argument("--arch", choices=ARCHS + PLANNED_ARCHS, default="llama")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (the tokenizer does not depend on it)")
    p.add_argument("--tie-word-embeddings", action="store_true", help="share embed_tokens with the LM head")
    p.add_argument("--head-dim", type=int, default=None, help="explicit head_dim != hidden/heads")
    p.add_argument("--rope-scaling", choices=("llama3", "yarn"), default=None,
                   help="llama3 (llama) or yarn with mscale (deepseek_v2); other DeepSeek variants "
                   "(q_lora_rank, topk_method, n_group, ...) go through --config-override")
    p.add_argument("--shards", type=int, default=1, help="split weights over K safetensors files + index")
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of stored weights (default: float32 for tiny/small, bfloat16 for bench)")
    p.add_argument("--config-override", type=json_object, default=None, metavar="JSON",
                   help='JSON object merged into config.json last, e.g. \'{"num_hidden_layers": 3}\'')
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.arch in PLANNED_ARCHS:
        print(f"llmserve make-model: --arch {args.arch} is not supported yet "
              f"(supported: {', '.join(ARCHS)})", file=sys.stderr)
        return 2
    from llmserve.modelgen.writer import make_model

    start = time.perf_counter()
    out = make_model(
        args.out, arch=args.arch, preset=args.preset, seed=args.seed,
        tie_word_embeddings=args.tie_word_embeddings, head_dim=args.head_dim,
        rope_scaling=args.rope_scaling, config_override=args.config_override,
        shards=args.shards, weights_dtype=args.weights_dtype,
    )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f}s")
    return 0
