"""`llmserve` command line: one subcommand per module, each adding its own subparser."""

import argparse
import os
from collections.abc import Callable, Sequence

from llmserve import client_commands, parent_death, router_command, serve_command, worker_command
from llmserve import protos_gen as gen_protos_command
from llmserve.bench import one_batch as bench_one_batch_command
from llmserve.eval import command as eval_ppl_command
from llmserve.modelgen import command as make_model_command
from llmserve.packaged_models import command as packaged_models_command
from tokenizer_svc import command as tokenizer_command

# Each entry adds one subparser and sets `func(args) -> int` as its default. New subcommands
# (serve, worker, bench-one-batch, ...) append their module's register here.
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
SUBCOMMANDS: tuple[Register, ...] = (
    make_model_command.register,
    packaged_models_command.register,
    bench_one_batch_command.register,
    eval_ppl_command.register,
    gen_protos_command.register,
    tokenizer_command.register,
    worker_command.register,
    serve_command.register,
    router_command.register,
    client_commands.register,
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
