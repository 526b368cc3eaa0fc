"""The import rules of docs/ARCHITECTURE.md, checked so that they stay true.

* every import points down the layers (a package may import only the layers
  listed for it below, and itself);
* the library never imports ``sparcml.tools`` (the command line's package);
* no module imports another module's private name (``_x``), or reaches into a
  private attribute of a name it imported (``SparseStream._x``);
* no import cycles between packages.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "sparcml"

CORE = {
    "stream", "merge", "kernels", "cpu_kernels", "wire", "indexcode", "errors", "reinterpret",
    "costmodel",
    "finite",
    "nonzero",
}  # fmt: skip
# layer -> the layers it may import (besides itself and the core)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "comm": set(),
    "compress": set(),
    "collectives": {"comm", "compress"},
    "sgd": set(),
    "ina": {"comm", "compress"},
    "torch": {"comm", "compress", "collectives", "sgd", "ina"},
    "top": {"comm", "compress", "collectives", "sgd", "ina", "torch"},  # sparcml/__init__
    "tools": {"comm", "compress", "collectives", "sgd", "ina", "torch", "top"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts == ["sparcml"]:
        return "top"
    head = parts[1]
    return "core" if head in CORE else head


def _module(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, imported names, line) of every import in ``path``."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return [(m, n, line) for m, n, line in out if m == "sparcml" or m.startswith("sparcml.")]


FILES = sorted(SRC.rglob("*.py"))


def _targets(mod: str, names: list[str]) -> list[str]:
    """The modules an import statement reaches: ``from sparcml import x`` (or
    ``from . import x`` at the top) reaches the subpackage or module ``x`` where one
    exists, else the top level."""
    if mod != "sparcml":
        return [mod]
    return [
        f"sparcml.{n}" if (SRC / n).is_dir() or (SRC / f"{n}.py").exists() else "sparcml"
        for n in names
    ]


def test_every_import_points_down_the_layers() -> None:
    bad = []
    for path in FILES:
        me = _module(path)
        mine = _layer(me)
        for mod, names, line in _imports(path):
            for target in _targets(mod, names):
                theirs = _layer(target)
                if theirs in (mine, "core") or theirs in ALLOWED[mine]:
                    continue
                bad.append(f"{me}:{line} ({mine}) imports {target} ({theirs})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_library_never_imports_the_tools() -> None:
    bad = [
        f"{_module(p)}:{line} imports {mod}"
        for p in FILES
        if _layer(_module(p)) != "tools"
        for mod, _, line in _imports(p)
        if _layer(mod) == "tools"
    ]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_modules() -> None:
    bad = []
    for path in FILES:
        me = _module(path)
        tree = ast.parse(path.read_text())
        imported: set[str] = set()
        for mod, names, line in _imports(path):
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{me}:{line} imports {mod}.{n}")
                imported.add(n)
            if mod.rpartition(".")[2].startswith("_") and mod.rpartition(".")[0] != (
                me if path.name == "__init__.py" else me.rpartition(".")[0]
            ):
                bad.append(f"{me}:{line} imports private module {mod} from another package")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{me}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(sorted(set(bad)))


def test_no_cycles_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for path in FILES:
        mine = _layer(_module(path))
        for mod, names, _ in _imports(path):
            for target in _targets(mod, names):
                theirs = _layer(target)
                if theirs != mine:
                    edges.setdefault(mine, set()).add(theirs)
    for a, b in itertools.permutations(edges, 2):
        assert not (b in edges.get(a, set()) and a in edges.get(b, set())), f"{a} <-> {b}"


def _own_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: ``self._x = ...``, class-level ``_x``, ``def _x``."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return {n for n in own if n.startswith("_") and not n.startswith("__")}


#: modules that rebuild or inspect other objects' fields by design
_FIELD_READERS = {"sparcml.torch.checkpoint"}
#: private names of PyTorch and the standard library that sparcml depends on (listed
#: here so that a new one is a decision: each is a place to watch on an upgrade)
_THIRD_PARTY = {
    "_exit",  # os._exit: a benchmark's killed rank
    "_get_default_store", "_get_process_group_name",  # c10d: the dedicated group's store
    "_get_fsdp_state", "_fsdp_param_group",  # FSDP2: which modules have gradients
    "_execution_engine",  # autograd: the callback at the end of backward
    "_SubParsersAction", "_actions",  # argparse: listing the subcommands
    "_version",  # Tensor: its version counter (a residual known to be zero, until written)
}  # fmt: skip


def test_no_private_attribute_or_field_stash_across_modules() -> None:
    """``obj._x`` only for a ``_x`` the module itself defines (its own class's field,
    read on another instance), never another module's private field; no
    ``obj.__dict__`` on an object other than ``self`` (stashing fields on it)."""
    bad = []
    for path in FILES:
        me = _module(path)
        tree = ast.parse(path.read_text())
        own = _own_private_names(tree) | _THIRD_PARTY
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            is_self = isinstance(holder, ast.Name) and (
                holder.id in ("self", "cls") or holder.id in own
            )
            if node.attr == "__dict__" and not is_self and me not in _FIELD_READERS:
                bad.append(f"{me}:{node.lineno} uses {ast.unparse(holder)}.__dict__")
            elif (
                node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not is_self
                and node.attr not in own
            ):
                bad.append(f"{me}:{node.lineno} uses {ast.unparse(holder)}.{node.attr}")
    assert not bad, "private fields used across modules:\n" + "\n".join(sorted(set(bad)))
