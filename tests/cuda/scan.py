"""Find the package's CUDA-only code by reading it (``ast``, no import): every construct whose
behaviour depends on the device being CUDA, keyed by a stable anchor — the file, the enclosing
function's qualified name and the construct — never a line number, so an edit elsewhere in the
file does not move it.

What counts (the construct's name is what the registry, ``tests/cuda/registry.py``, holds):

- ``torch.cuda.<name>`` and ``torch.accelerator.<name>``: any use (calls, streams, events, RNG,
  memory statistics); ``torch.Stream`` / ``torch.Event``;
- ``.pin_memory()`` / ``pin_memory=True``, ``.is_pinned()``, ``non_blocking=True``,
  ``.record_stream()`` / ``.wait_event()`` / ``.wait_stream()``, ``.cuda()``, ``.is_cuda``;
- a comparison with the device names ``"cuda"`` / ``"cpu"`` (``device.type == "cuda"``,
  ``!= "cpu"``), or the backend names ``"nccl"`` / ``"gloo"`` (NCCL is CUDA's backend), and
  ``torch.device("cuda")``;
- device-to-host copies, ``.to("cpu")`` / ``.cpu()`` (a copy over PCIe from a CUDA tensor);
- the kernels CUDA selects differently from CPU: ``fused=True`` (torch's fused optimizers),
  ``grouped_mm``, ``scaled_dot_product_attention`` (flash / memory-efficient kernels, their
  dropout), ``torch.compile`` (inductor's CUDA code generation).

Standard library only, so the CPU test (tests/test_cuda_registry.py) costs milliseconds.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "megatron_p2r"

DEVICE_NAMES = ("cuda", "cpu")
BACKEND_NAMES = ("nccl", "gloo")
METHODS = {
    "pin_memory": ".pin_memory()",
    "is_pinned": ".is_pinned()",
    "record_stream": ".record_stream()",
    "wait_event": ".wait_event()",
    "wait_stream": ".wait_stream()",
    "cuda": ".cuda()",
    "cpu": ".cpu()",
}
KEYWORDS = {"pin_memory": "pin_memory=True", "non_blocking": "non_blocking=True", "fused": "fused=True"}
KERNELS = ("grouped_mm", "scaled_dot_product_attention")
OPERATORS = {ast.Eq: "==", ast.Is: "==", ast.NotEq: "!=", ast.IsNot: "!=", ast.In: "in", ast.NotIn: "not in"}


@dataclass(frozen=True, order=True)
class Construct:
    file: str  # under megatron_p2r/, e.g. "parallel/grad_buffer.py"
    anchor: str  # the enclosing function's qualified name ("<module>" at top level)
    construct: str  # e.g. "torch.cuda.synchronize", "device == \"cuda\"", ".pin_memory()"
    line: int = 0  # where it was seen first (for the message only; not part of the key)

    @property
    def key(self) -> Tuple[str, str, str]:
        return self.file, self.anchor, self.construct


def _strings(node: ast.AST) -> List[str]:
    """The string constants of a comparison operand: "x" or ("x", "y")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in (False, None)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def constructs_of(node: ast.AST) -> Iterator[str]:
    """The CUDA-only constructs one node is (usually none)."""
    if isinstance(node, ast.Attribute):
        dotted = _dotted(node)
        for prefix in ("torch.cuda.", "torch.accelerator."):
            if dotted.startswith(prefix) and dotted.count(".") == 2:
                yield dotted
        if dotted in ("torch.Stream", "torch.Event"):
            yield dotted
        if node.attr == "is_cuda":
            yield ".is_cuda"
    elif isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            name = OPERATORS.get(type(op))
            if name is None:
                continue
            for value in _strings(operands[i]) + _strings(operands[i + 1]):
                if value in DEVICE_NAMES:
                    yield f'device {name} "{value}"'
                elif value in BACKEND_NAMES:
                    yield f'backend {name} "{value}"'
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            method = METHODS.get(func.attr)
            if method and not (func.attr == "cuda" and _dotted(func) == "torch.cuda"):
                yield method
            if func.attr == "to" and any(s == "cpu" for a in node.args[:1] for s in _strings(a)):
                yield '.to("cpu")'
            if func.attr == "to" and any(k.arg == "device" and _strings(k.value) == ["cpu"] for k in node.keywords):
                yield '.to("cpu")'
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in KERNELS:
            yield name
        if _dotted(func) == "torch.compile":
            yield "torch.compile"
        if _dotted(func) == "torch.device" and node.args and _strings(node.args[0]) == ["cuda"]:
            yield 'torch.device("cuda")'
        for k in node.keywords:
            if k.arg in KEYWORDS and not _is_false(k.value):
                yield KEYWORDS[k.arg]


class _Visitor(ast.NodeVisitor):
    def __init__(self, file: str):
        self.file, self.scope, self.found = file, [], {}

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def generic_visit(self, node: ast.AST) -> None:
        for construct in constructs_of(node):
            key = (self.file, ".".join(self.scope) or "<module>", construct)
            if key not in self.found:
                self.found[key] = Construct(*key, line=getattr(node, "lineno", 0))
        super().generic_visit(node)


def package_files(root: str = ROOT) -> List[str]:
    """Every module of the package, relative to ``megatron_p2r/``, sorted."""
    base = os.path.join(root, PACKAGE)
    out = []
    for d, _, files in os.walk(base):
        out += [os.path.relpath(os.path.join(d, f), base) for f in files if f.endswith(".py")]
    return sorted(p.replace(os.sep, "/") for p in out)


def scan_source(file: str, source: str) -> List[Construct]:
    visitor = _Visitor(file)
    visitor.visit(ast.parse(source, filename=file))
    return sorted(visitor.found.values())


def scan_package(root: str = ROOT) -> List[Construct]:
    """Every CUDA-only construct of the package, one per (file, anchor, construct)."""
    out = []
    for rel in package_files(root):
        with open(os.path.join(root, PACKAGE, rel), encoding="utf-8") as fh:
            out += scan_source(rel, fh.read())
    return out


def anchors_of(source: str) -> Set[str]:
    """The qualified names of every class and function of a module (and ``<module>``)."""
    names: Set[str] = {"<module>"}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                names.add(name)
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return names


def test_functions(root: str = ROOT) -> Dict[str, Set[str]]:
    """{tests/cuda/<module>.py: the names of its test functions (``Class::test`` inside classes)}
    for the modules of tests/cuda that are marked ``cuda`` (``pytestmark = pytest.mark.cuda``)."""
    base = os.path.join(root, "tests", "cuda")
    out = {}
    for f in sorted(os.listdir(base)):
        if not (f.startswith("test_") and f.endswith(".py")):
            continue
        with open(os.path.join(base, f), encoding="utf-8") as fh:
            source = fh.read()
        if "pytest.mark.cuda" not in source:
            continue
        tree = ast.parse(source)
        names = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                names.add(node.name)
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                names |= {
                    f"{node.name}::{n.name}"
                    for n in node.body
                    if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
                }
        out[f"tests/cuda/{f}"] = names
    return out


# ----------------------------------------------------------------------------- the audit


def entry_line(file: str, anchor: str, construct: str, test: str) -> str:
    """The registry line for one construct, as it is written in tests/cuda/registry.py."""
    quoted = f"'{construct}'" if '"' in construct else f'"{construct}"'
    return f'    E("{file}", "{anchor}", {quoted}, {test}),'


def _test_exists(test: str, tests: Dict[str, Set[str]], sources: Dict[str, str]) -> bool:
    """``tests/cuda/<module>.py::<name>[<param id>]``: the module is a lane module (marked
    ``cuda``), it defines the test, and the parameter id, if any, is spelled in it."""
    module, _, name = test.partition("::")
    name, _, param = name.partition("[")
    if module not in tests or name not in tests[module]:
        return False
    return not param or param.rstrip("]") in sources.get(module, "")


def audit(found: List[Construct], registry: list, behaviours: list, root: str = ROOT) -> List[str]:
    """Every problem of the registry against the package as it is: a construct without a line
    (the message is the line to add), a line whose construct is gone (stale), a line naming a
    test that does not exist, a behaviour whose anchor is gone. Empty when complete."""
    tests = test_functions(root)
    sources = {}
    for module in tests:
        with open(os.path.join(root, module), encoding="utf-8") as fh:
            sources[module] = fh.read()
    registered = {(e.file, e.anchor, e.construct): e for e in registry}
    by_anchor = {(e.file, e.anchor): e.test for e in registry}
    problems = []
    for c in found:
        if c.key not in registered:
            test = by_anchor.get((c.file, c.anchor), '"tests/cuda/<module>.py::<the test that runs it on CUDA>"')
            test = test if test.startswith('"') or not test else f'"{test}"'
            problems.append(
                f"unregistered: megatron_p2r/{c.file}:{c.line} ({c.anchor}) uses {c.construct}; add to "
                f"CUDA_ONLY in tests/cuda/registry.py (sorted by file):\n{entry_line(*c.key, test)}"
            )
    seen = {c.key for c in found}
    for key, e in registered.items():
        if key not in seen:
            problems.append(
                f"stale: the scan no longer finds {e.construct} in megatron_p2r/{e.file} ({e.anchor}); "
                f"remove (or re-anchor) this line of tests/cuda/registry.py:\n"
                f"{entry_line(e.file, e.anchor, e.construct, repr(e.test))}"
            )
    anchors: Dict[str, Set[str]] = {}
    for e in behaviours:
        path = os.path.join(root, PACKAGE, e.file)
        if e.file not in anchors:
            anchors[e.file] = set()
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    anchors[e.file] = anchors_of(fh.read())
        if e.anchor not in anchors[e.file]:
            problems.append(
                f"stale behaviour: megatron_p2r/{e.file} has no {e.anchor} any more ({e.construct}); "
                "re-anchor it in BEHAVIOURS of tests/cuda/registry.py"
            )
    for e in [*registry, *behaviours]:
        if not _test_exists(e.test, tests, sources):
            problems.append(
                f"no such lane test: {e.test} (named for {e.construct} in megatron_p2r/{e.file}, "
                f"{e.anchor}); lane tests live in tests/cuda/test_*.py, marked cuda"
            )
    return problems
