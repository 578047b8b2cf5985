"""Regenerate (or verify) the committed Python code of protos/ (`llmserve gen-protos [--check]`).

Layout: `protos/llmserve/v1/x.proto` is compiled with `-I protos` into the repository root, so its
modules land at `llmserve/v1/x_pb2.py`, `x_pb2.pyi` and `x_pb2_grpc.py`, inside this package. The
absolute imports grpc_tools writes (`from llmserve.v1 import tokenizer_pb2`) then resolve as they
are, with no sys.path tricks: `from llmserve.v1 import router_pb2, router_pb2_grpc`.

The generated files are committed (installing needs no grpcio-tools); `--check` regenerates into a
temporary folder and fails when anything differs, is missing, or is stale (generated code whose
.proto is gone). The output depends on the grpcio-tools version, which pyproject.toml pins.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
# Generated modules go under the repository root, mirroring the proto paths.
OUT_ROOT = REPO_ROOT
# Only this tree may hold generated modules (a safety fence for the stale-file scan and writes).
GENERATED_PACKAGE = "llmserve"
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_INIT_TEXT = '"""Generated from protos/{rel}/*.proto by `llmserve gen-protos`. Do not edit."""\n'


@dataclass(frozen=True)
class Drift:
    missing: list[str]
    stale: list[str]
    changed: list[str]

    def __bool__(self) -> bool:
        return bool(self.missing or self.stale or self.changed)


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files, relative to proto_root, sorted."""
    files = sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))
    for rel in files:
        if rel.parts[0] != GENERATED_PACKAGE:
            raise ValueError(f"protos/{rel}: proto files must live under protos/{GENERATED_PACKAGE}/ "
                             "so their generated modules land inside the llmserve package")
    return files


def _protoc(proto_root: Path, out_dir: Path, files: list[Path]) -> None:
    try:
        from grpc_tools import protoc
    except ImportError as e:  # a runtime install has no grpcio-tools
        raise SystemExit("llmserve gen-protos needs grpcio-tools (pip install -e '.[dev]')") from e
    import importlib.resources

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *(str(f) for f in files)]
    # File arguments relative to -I keep `source:` comments and descriptor names free of this
    # machine's absolute paths.
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"llmserve gen-protos: protoc failed (exit {rc}); see the errors above")


def generate(proto_root: Path = PROTO_ROOT) -> dict[str, bytes]:
    """All generated files as {path relative to OUT_ROOT: content}."""
    files = proto_files(proto_root)
    if not files:
        raise SystemExit(f"llmserve gen-protos: no .proto files under {proto_root}")
    with tempfile.TemporaryDirectory(prefix="llmserve-protos-") as tmp:
        _protoc(proto_root, Path(tmp), files)
        out = {p.relative_to(tmp).as_posix(): p.read_bytes()
               for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
    # Every folder holding generated modules (below the top package, which the project owns)
    # is a regular package, so setuptools' find_packages ships it.
    for rel in sorted({f.parent for f in files}):
        for depth in range(1, len(rel.parts)):
            pkg = Path(*rel.parts[: depth + 1])
            out.setdefault((pkg / "__init__.py").as_posix(), _INIT_TEXT.format(rel=pkg.as_posix()).encode())
    return out


def _existing_generated(out_root: Path) -> set[str]:
    found = set()
    for p in (out_root / GENERATED_PACKAGE).rglob("*"):
        if p.is_file() and p.name.endswith(_GENERATED_SUFFIXES):
            found.add(p.relative_to(out_root).as_posix())
    return found


def compare(expected: dict[str, bytes], out_root: Path = OUT_ROOT) -> Drift:
    missing, changed = [], []
    for rel, content in expected.items():
        path = out_root / rel
        if not path.is_file():
            missing.append(rel)
        elif path.read_bytes() != content:
            changed.append(rel)
    stale = sorted(_existing_generated(out_root) - set(expected))
    return Drift(missing=missing, stale=stale, changed=changed)


def write(expected: dict[str, bytes], out_root: Path = OUT_ROOT) -> Drift:
    drift = compare(expected, out_root)
    for rel in drift.missing + drift.changed:
        path = out_root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(expected[rel])
    for rel in drift.stale:
        (out_root / rel).unlink()
    return drift


def grpc_tools_versions(expected: dict[str, bytes], out_root: Path) -> tuple[str | None, str | None]:
    """(version the committed code was generated with, version installed), from GRPC_GENERATED_VERSION."""
    pattern = re.compile(rb"GRPC_GENERATED_VERSION = '([^']+)'")
    for rel, content in expected.items():
        if rel.endswith("_pb2_grpc.py") and (out_root / rel).is_file():
            ours, theirs = pattern.search(content), pattern.search((out_root / rel).read_bytes())
            return (theirs.group(1).decode() if theirs else None), (ours.group(1).decode() if ours else None)
    return None, None
