"""`llmserve` command line: the subcommands of llmserve/commands/, each module adding its own subparser."""

import argparse
import os
from collections.abc import Callable, Sequence

from llmserve import parent_death
from llmserve.commands import (
    bench_one_batch,
    bench_serving,
    client,
    eval_ppl,
    gen_protos,
    make_model,
    models,
    router,
    serve,
    tokenizer,
    worker,
)

# Each entry adds one subparser and sets `func(args) -> int` as its default. New subcommands
# (serve, worker, bench-one-batch, ...) append their module's register here.
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
SUBCOMMANDS: tuple[Register, ...] = (
    make_model.register,
    models.register,
    bench_one_batch.register,
    bench_serving.register,
    eval_ppl.register,
    gen_protos.register,
    tokenizer.register,
    worker.register,
    serve.register,
    router.register,
    client.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="gRPC LLM serving")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # A child of `serve` or of a TP leader dies with it (the portable half of llmserve/parent_death.py).
    parent_death.watch_parent(os.environ)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
