"""`llmserve eval-ppl`: perplexity of a model folder over a real text, through this engine's forward,
with top-1 agreement against a reference (HF transformers in fp32, or an earlier run's result file)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

from llmserve.commands.engine_args import add_engine_args, engine_config_from_args

DEFAULT_TEXT = "alice_ch1_2.txt"


def shipped_text(name: str = DEFAULT_TEXT) -> str:
    return resources.files("llmserve.eval").joinpath("texts", name).read_text(encoding="utf-8")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "eval-ppl", help="perplexity over a real text through this engine (sliding window)",
        description="Tokenizes the text once, scores every token after the first with windows of at "
        "most --window tokens starting every --stride tokens (each token scored once, with at least "
        "window - stride tokens of context), and reports perplexity; --reference adds top-1 "
        f"agreement. Default text: Alice in Wonderland chapters I-II (llmserve/eval/texts/{DEFAULT_TEXT}).")
    add_engine_args(p)
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: the shipped text)")
    p.add_argument("--window", type=int, default=1024, help="tokens per forward (default 1024)")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    p.add_argument("--reference", default=None, metavar="hf|FILE",
                   help="hf: HF transformers fp32 on the same folder; FILE: an earlier --result-file")
    p.add_argument("--result-file", type=Path, default=None, help="write the result (with predictions) as JSON")
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--tp-init-addr", default=None, metavar="HOST:PORT")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (per rank)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch
    from tokenizers import Tokenizer

    from llmserve.bench.runners import open_runner
    from llmserve.eval.perplexity import EngineScorer, HFScorer, PerplexityResult, perplexity
    from worker_svc.executor.compute_priority import lower_compute_priority

    if args.threads:
        torch.set_num_threads(args.threads)
    text = args.text.read_text(encoding="utf-8") if args.text else shipped_text()
    ids = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")).encode(text).ids
    engine = engine_config_from_args(args)
    lower_compute_priority(engine.compute_nice)  # this thread runs the steps (rank 0's)
    if engine.max_total_tokens is None or engine.max_total_tokens < args.window:
        engine = dataclasses.replace(engine, max_total_tokens=args.window)
    try:
        start = time.perf_counter()
        with open_runner(engine, args.tp, args.tp_init_addr, args.threads) as runner:
            result = perplexity(EngineScorer(runner), ids, args.window, args.stride)
            dtype = str(runner.dtype).removeprefix("torch.")
        seconds = time.perf_counter() - start
    except ValueError as exc:
        print(f"llmserve eval-ppl: {exc}", file=sys.stderr)
        return 2
    label = f"{dtype}, {engine.torchao_config}{' + LM head' if engine.quantize_lm_head else ''}, tp {args.tp}"
    print(f"text: {len(text)} characters, {len(ids)} tokens; {result.windows} windows of <= {args.window} "
          f"tokens, stride {args.stride}; {result.tokens_scored} tokens scored")
    print(f"perplexity {result.perplexity:.4f}  (mean NLL {result.nll_sum / result.tokens_scored:.5f}; {label}; "
          f"{seconds:.1f} s)")
    record = {"model": args.model, "config": label, **result.to_json()}
    if args.reference:
        if args.reference == "hf":
            reference = perplexity(HFScorer(args.model), ids, args.window, args.stride)
            ref_label = "HF transformers float32"
        else:
            reference = PerplexityResult.from_json(json.loads(Path(args.reference).read_text()))
            ref_label = args.reference
        agreement = result.top1_agreement(reference)
        print(f"reference ({ref_label}): perplexity {reference.perplexity:.4f}; top-1 agreement {agreement:.4f}")
        record["reference"] = {"label": ref_label, "perplexity": reference.perplexity, "top1_agreement": agreement}
    if args.result_file:
        args.result_file.write_text(json.dumps(record))
    return 0
