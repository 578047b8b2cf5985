"""`llmserve gen-protos [--check]`: regenerate (or verify) the committed Python code of protos/
(llmserve/protos_gen.py)."""

from __future__ import annotations

import argparse
import sys

from llmserve.protos_gen import OUT_ROOT, compare, generate, grpc_tools_versions, write


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "gen-protos",
        help="regenerate the Python modules of protos/*.proto (committed under llmserve/v1/)",
        description="Compile protos/**/*.proto with grpc_tools into the llmserve package. "
        "With --check, write nothing and exit 1 when the committed files differ.",
    )
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the committed generated files differ from what the .proto files give")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    expected = generate()
    if not args.check:
        drift = write(expected)
        n = len(drift.missing) + len(drift.changed) + len(drift.stale)
        print(f"llmserve gen-protos: {len(expected)} files, {n} updated"
              + "".join(f"\n  wrote {r}" for r in drift.missing + drift.changed)
              + "".join(f"\n  removed stale {r}" for r in drift.stale))
        return 0
    drift = compare(expected)
    if not drift:
        print(f"llmserve gen-protos --check: {len(expected)} generated files are up to date")
        return 0
    lines = ["llmserve gen-protos --check: generated code is out of date with protos/:"]
    lines += [f"  missing: {r}" for r in drift.missing]
    lines += [f"  differs: {r}" for r in drift.changed]
    lines += [f"  stale (no .proto): {r}" for r in drift.stale]
    committed, installed = grpc_tools_versions(expected, OUT_ROOT)
    if committed and installed and committed != installed:
        lines.append(f"  note: committed code was made by grpcio-tools {committed}, this is {installed}; "
                     "install the pinned version")
    lines.append("Run `llmserve gen-protos` and commit the result.")
    print("\n".join(lines), file=sys.stderr)
    return 1
