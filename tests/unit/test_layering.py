"""Imports go downward (docs/architecture.md): inside worker_svc, a package imports only packages of
lower layers (or itself); across the tree, the services never import the command line, the light
side (router, tokenizer service) never imports the worker, and llmserve's shared modules import
no service. Read from the source with `ast` (function-local imports count; imports under
`if TYPE_CHECKING:` do not, they are annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# worker_svc, bottom to top; packages on one line share a layer and may not import each other.
WORKER_LAYERS: list[set[str]] = [
    {"config", "forward_batch", "kvcache", "sampling", "kernels"},
    {"parallel", "attention"},
    {"layers"},
    {"models"},
    {"executor"},
    {"engine"},
    {"server"},
]
# llmserve's modules that services may import: they import no service and no command.
LLMSERVE_SHARED = {"arg_types", "grpc_server", "grpc_wire", "kv_hash", "logging", "message_limits", "metrics",
                   "parent_death", "security", "security_args", "supervisor", "v1", "worker_protocol"}
# Who may not import whom, across the top-level packages (prefix match on the imported module).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "worker_svc": ("router", "tokenizer_svc", "llmserve.commands", "llmserve.cli", "llmserve.bench"),
    "router": ("worker_svc", "tokenizer_svc", "llmserve.commands", "llmserve.cli", "llmserve.bench"),
    "tokenizer_svc": ("worker_svc", "router", "llmserve.commands", "llmserve.cli", "llmserve.bench"),
}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import outside `if TYPE_CHECKING:` blocks; `from pkg import b`
    of a top-level package gives `pkg.b` (b is a module there), `from a.b import c` gives `a.b`."""
    found: list[tuple[int, str]] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.extend((node.lineno, alias.name) for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if not node.module or node.level:
                return
            if "." in node.module:
                found.append((node.lineno, node.module))
            else:
                found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)

    Visitor().visit(ast.parse(source))
    return found


def _worker_layer(package: str) -> int | None:
    for i, layer in enumerate(WORKER_LAYERS):
        if package in layer:
            return i
    return None


def violations(root: Path) -> list[str]:
    """Every import of the tree under `root` that breaks the layering, as `file:line: reason`."""
    out: list[str] = []
    for top in ("worker_svc", "router", "tokenizer_svc", "llmserve"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            parts = rel.with_suffix("").parts
            if parts[0] == "llmserve" and (len(parts) < 2 or parts[1] not in LLMSERVE_SHARED):
                continue  # the command line and the tools on top may import anything
            for line, module in runtime_imports(path.read_text()):
                where = f"{rel}:{line}"
                if parts[0] == "llmserve" and module.split(".")[0] in ("worker_svc", "router", "tokenizer_svc"):
                    out.append(f"{where}: shared module llmserve.{parts[1]} imports the service {module}")
                for banned in FORBIDDEN.get(parts[0], ()):
                    if module == banned or module.startswith(banned + "."):
                        out.append(f"{where}: {parts[0]} imports {module}")
                if parts[0] != "worker_svc" or len(parts) < 2 or not module.startswith("worker_svc."):
                    continue
                mine, theirs = parts[1], module.split(".")[1]
                if mine == theirs or mine == "__init__":
                    continue
                my_layer, their_layer = _worker_layer(mine), _worker_layer(theirs)
                if my_layer is None:
                    out.append(f"{where}: worker_svc.{mine} is in no layer of WORKER_LAYERS")
                elif their_layer is not None and their_layer >= my_layer:
                    out.append(f"{where}: worker_svc.{mine} (layer {my_layer}) imports {module} (layer {their_layer})")
    return sorted(set(out))


def test_every_import_goes_downward() -> None:
    assert violations(ROOT) == []


def test_every_worker_package_has_a_layer() -> None:
    packages = {p.stem if p.is_file() else p.name for p in (ROOT / "worker_svc").iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    placed = set().union(*WORKER_LAYERS)
    assert packages == placed


@pytest.mark.parametrize("where, text, expected", [
    # A lower layer importing a higher one, at run time (function-local imports count).
    ("worker_svc/layers/linear.py", "def f():\n    from worker_svc.engine.scheduler import Scheduler\n",
     "worker_svc.layers (layer 2) imports worker_svc.engine.scheduler (layer 5)"),
    # Two packages of one layer.
    ("worker_svc/attention/base.py", "from worker_svc.parallel import context\n",
     "worker_svc.attention (layer 1) imports worker_svc.parallel"),
    ("router/server.py", "import worker_svc.engine\n", "router imports worker_svc"),
    ("worker_svc/server/app.py", "from llmserve.commands.worker import run\n", "worker_svc imports llmserve.commands"),
    ("llmserve/logging.py", "from router.server import serve\n", "shared module llmserve.logging imports the service"),
])
def test_a_violation_is_caught(tmp_path: Path, where: str, text: str, expected: str) -> None:
    target = tmp_path / where
    target.parent.mkdir(parents=True)
    target.write_text(text)
    found = violations(tmp_path)
    assert len(found) == 1 and expected in found[0], found


def test_type_only_imports_do_not_count(tmp_path: Path) -> None:
    target = tmp_path / "worker_svc" / "attention" / "base.py"
    target.parent.mkdir(parents=True)
    target.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from worker_svc.engine.engine import Engine\n")
    assert violations(tmp_path) == []
