"""Module boundaries: no import cycles between megatron_p2r's subpackages, counting every import
(also those inside functions, which hide a cycle from Python but not from a reader), and every
subpackage importable on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "megatron_p2r"


def _unit(module: str) -> str:
    """megatron_p2r.<subpackage or top-level module>: the unit cycles are counted between."""
    return ".".join(module.split(".")[:2])


def _imports(path: str, module: str) -> Set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith(PKG + ".")}


def import_graph(root: str = ROOT) -> Dict[str, Set[str]]:
    """unit -> the other units it imports, anywhere in its modules."""
    edges: Dict[str, Set[str]] = defaultdict(set)
    for folder, _, files in os.walk(os.path.join(root, PKG)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            me = _unit(module)
            edges[me] |= {_unit(t) for t in _imports(path, module) if _unit(t) not in (me, PKG)}
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one unit."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_subpackages_lazy_imports_included():
    assert cycles(import_graph()) == []


def test_the_check_sees_a_cycle_through_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    for d in (pkg, pkg / "a", pkg / "b"):
        (d / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megatron_p2r.b.y import g\n")
    (pkg / "b" / "y.py").write_text("def g():\n    from megatron_p2r.a import x\n    return x\n")
    assert cycles(import_graph(str(tmp_path))) == [[f"{PKG}.a", f"{PKG}.b"]]


def test_config_and_layout_stay_at_the_bottom():
    """config depends on nothing of ours; layout (the plan) only on config."""
    edges = import_graph()
    assert edges[f"{PKG}.config"] == set()
    assert edges[f"{PKG}.layout"] <= {f"{PKG}.config"}


def test_the_checkpoint_format_sits_below_conversion():
    """checkpoint (the on-disk format, save and load) imports no conversion and no training policy
    that conversion applies (delinking, growth, the LR re-warm-up); convert builds on it."""
    imported = set()
    for folder, _, files in os.walk(os.path.join(ROOT, PKG, "checkpoint")):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            imported |= _imports(path, module)
    policy = (f"{PKG}.convert", f"{PKG}.p2r", f"{PKG}.optim.scheduler", f"{PKG}.training")
    assert [m for m in sorted(imported) if m.startswith(policy)] == []
    assert f"{PKG}.checkpoint" in import_graph()[f"{PKG}.convert"]


def test_the_planner_reads_checkpoint_ownership_from_the_plan_not_the_format():
    """planning counts what a save writes from layout.ownership, which the checkpoint's tensor
    table and parallel save read too, so the planner does not depend on the on-disk format."""
    assert f"{PKG}.checkpoint" not in import_graph()[f"{PKG}.planning"]


SUBPACKAGES = sorted(
    {
        _unit(os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, "."))
        for folder, _, files in os.walk(os.path.join(ROOT, PKG))
        for name in files
        if name.endswith(".py")
    }
    - {PKG + ".__init__"}
)


def test_each_subpackage_imports_alone():
    """One fresh interpreter imports each unit first thing (an import-time cycle raises there)."""
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('megatron_p2r')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *SUBPACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
