"""The docs name only what exists, and print what their commands print.

Every repository path that README.md, docs/*.md and examples/**/README.md mention
(``megatron_p2r/...``, ``tools/...``, ``tests/...``, ``benchmarks/...``, ``examples/...``,
``docs/...``, and a package module written from its subpackage, ``layout/sharing.py``) is in
the tree; every ``path.py::test`` and ``path.py:name``
is defined in that file; every dotted name of ours (``parallel.ddp.DistributedDataParallel``,
``ParallelPlan.for_world``) resolves. Names are looked up in the sources' syntax trees, so
nothing is imported. Where a command takes seconds, the table a doc prints beside it is
compared with the command's output. Every guide ends by naming its evidence appendix
(``docs/evidence/<topic>.md``: measurements, test inventories, planted bugs), and every command
in a doc's code blocks runs something that exists: a script, a module, a ``make`` target or a
console entry of ``setup.py``."""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import os
import re
from collections import defaultdict
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_p2r"
SOURCE_ROOTS = (PACKAGE, "tools", "benchmarks", "tests")
REPO_DIRS = (PACKAGE, "tools", "tests", "benchmarks", "examples", "docs")
# A dotted word ending so is a file name (``config.json``, ``model.yaml``), not a Python name.
FILE_SUFFIXES = {
    "py",
    "md",
    "json",
    "jsonl",
    "yaml",
    "yml",
    "sh",
    "sbatch",
    "txt",
    "bin",
    "idx",
    "safetensors",
    "png",
    "pt",
    "gz",
    "model",
    "toml",
    "ini",
    "csv",
    "log",
    "html",
    "whl",
    "lock",
    "tmp",
    "so",
}


def doc_files(root: str = ROOT) -> List[str]:
    found = [
        os.path.join(root, "README.md"),
        *sorted(glob.glob(os.path.join(root, "docs", "*.md"))),
        *sorted(glob.glob(os.path.join(root, "examples", "**", "README.md"), recursive=True)),
    ]
    return [os.path.relpath(p, root) for p in found]


# The reports p2r-study writes into docs/ (``--out docs --name ...``): its output, not guides.
GENERATED_REPORTS = {
    "docs/p2r_study_code.md",
    "docs/p2r_study_code_x4.md",
    "docs/p2r_study_docs.md",
    "docs/p2r_study_docs_x4.md",
}
# Guides still mixed with their evidence. The lead splits them (issue 39 item 5) and removes each
# from this list; once it is empty every guide must name its evidence.
PENDING_GUIDES = set()
_EVIDENCE_LINE = re.compile(r"^Evidence: (docs/evidence/[\w-]+\.md(?:, docs/evidence/[\w-]+\.md)*)\.?$")


def evidence_files(root: str = ROOT) -> List[str]:
    """The appendices: records of what was measured, planted and reverted, so the names they
    mention may be gone (a planted file); their commands are checked, their names are not."""
    return [os.path.relpath(p, root) for p in sorted(glob.glob(os.path.join(root, "docs", "evidence", "*.md")))]


def guide_files(root: str = ROOT) -> List[str]:
    """docs/*.md less the study's generated reports: the guides a user reads."""
    found = sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return [d for d in (os.path.relpath(p, root) for p in found) if d not in GENERATED_REPORTS]


class SourceIndex:
    """What the repository's Python defines: module -> its top-level names; class name -> the
    attributes of every class of that name (methods, class attributes, fields, ``self.x``)."""

    def __init__(self, root: str = ROOT):
        self.modules: Dict[str, Set[str]] = {}
        self.classes: Dict[str, Set[str]] = defaultdict(set)
        files = [os.path.join(root, "pretrain_m6.py")]
        for top in SOURCE_ROOTS:
            files += glob.glob(os.path.join(root, top, "**", "*.py"), recursive=True)
        for path in files:
            rel = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
            self.modules[module] = self._top_level(tree) | self._submodules(path, root)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name] |= self._attributes(node)

    @staticmethod
    def _submodules(path: str, root: str) -> Set[str]:
        if not path.endswith("__init__.py"):
            return set()
        here = os.path.dirname(path)
        return {
            name[:-3] if name.endswith(".py") else name
            for name in os.listdir(here)
            if name.endswith(".py") or os.path.isfile(os.path.join(here, name, "__init__.py"))
        }

    @staticmethod
    def _top_level(tree: ast.Module) -> Set[str]:
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        return names

    @staticmethod
    def _attributes(cls: ast.ClassDef) -> Set[str]:
        names = SourceIndex._top_level(ast.Module(body=cls.body, type_ignores=[]))
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and isinstance(node.ctx, ast.Store)
            ):
                names.add(node.attr)
        return names

    def _module_of(self, parts: List[str]) -> Tuple[Optional[str], List[str]]:
        """The longest leading parts that name a module of ours, and the parts after it."""
        for n in range(len(parts), 0, -1):
            for prefix in ("", PACKAGE + "."):
                module = prefix + ".".join(parts[:n])
                if module in self.modules:
                    return module, parts[n:]
        return None, parts

    def is_ours(self, dotted: str) -> bool:
        head = dotted.split(".")[0]
        return head in self.classes or self._module_of([head])[0] is not None

    def missing(self, dotted: str) -> Optional[str]:
        """None when ``dotted`` resolves; else the part that does not. Two words whose first is
        a package and whose second it does not hold are a variable named like the package
        (``model.named_parameters()``, the metadata key ``p2r.phase``), not a reference."""
        parts = dotted.split(".")
        module, rest = self._module_of(parts)
        if module is None:  # Class.attribute
            cls, rest = parts[0], parts[1:]
        elif not rest or (len(parts) == 2 and rest[0] not in self.modules[module]):
            return None
        elif rest[0] not in self.modules[module]:
            return f"{module}.{rest[0]}"
        else:
            cls, rest = rest[0], rest[1:]
        if rest and cls in self.classes and rest[0] not in self.classes[cls]:
            return f"{cls}.{rest[0]}"
        return None

    def defines(self, path: str, name: str) -> bool:
        """Whether the file at ``path`` (repository-relative) defines ``name`` (``Class.method``
        allowed) at its top level."""
        module = path[: -len(".py")].replace("/", ".")
        module = module[: -len(".__init__")] if module.endswith(".__init__") else module
        return module in self.modules and self.missing(f"{module}.{name}") is None


_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*[\w*/])((?:::?)[A-Za-z_][\w.]*)?" % "|".join(REPO_DIRS))
_EXTERNAL_LINK = re.compile(r"\[([^\]]*)\]\(https?://[^)]*\)")  # its text names another repository's file
_DOTTED = re.compile(r"(?<![\w./:-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def _subpackages(root: str = ROOT) -> List[str]:
    return sorted(
        d
        for d in os.listdir(os.path.join(root, PACKAGE))
        if os.path.isfile(os.path.join(root, PACKAGE, d, "__init__.py"))
    )


def path_references(text: str, root: str = ROOT) -> Iterator[Tuple[str, Optional[str]]]:
    """(repository path, name after ``:`` or ``::`` or None) of every path the text names."""
    for m in _PATH.finditer(text):
        yield m.group(1).rstrip("."), (m.group(2) or "").lstrip(":") or None
    relative = re.compile(r"(?<![\w./-])((?:%s)/[\w/]*\w\.py)(:{1,2}[A-Za-z_]\w*)?" % "|".join(_subpackages(root)))
    for m in relative.finditer(text):
        yield f"{PACKAGE}/{m.group(1)}", (m.group(2) or "").lstrip(":") or None


def dotted_references(text: str, index: SourceIndex) -> Iterator[str]:
    """Every dotted word whose first part is a module or class of ours, file names left out."""
    for m in _DOTTED.finditer(text):
        word = m.group(1)
        if word.rsplit(".", 1)[1] not in FILE_SUFFIXES and index.is_ours(word):
            yield word


def problems(doc: str, index: SourceIndex, root: str = ROOT) -> List[str]:
    with open(os.path.join(root, doc), encoding="utf-8") as fh:
        text = _EXTERNAL_LINK.sub("", fh.read())
    found = []
    for path, name in path_references(text, root):
        if not glob.glob(os.path.join(root, path)):
            found.append(f"{doc}: {path} does not exist")
        elif name and path.endswith(".py") and not index.defines(path, name):
            found.append(f"{doc}: {path} defines no {name}")
    for word in dotted_references(text, index):
        missing = index.missing(word)
        if missing:
            found.append(f"{doc}: {word}: no {missing}")
    return sorted(set(found))


@pytest.fixture(scope="module")
def index():
    return SourceIndex()


@pytest.mark.parametrize("doc", doc_files())
def test_docs_name_only_what_exists(doc, index):
    assert problems(doc, index) == []


def test_the_check_sees_a_bad_path_and_a_bad_name(index, tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text(
        "See `tests/parallel/test_state.py`, `p2r/sharing.py`, `layout/plan.py:no_such_thing`, "
        "`parallel.ddp.NoSuchClass` and `ParallelPlan.no_such_method`; `layout/sharing.py`, "
        "`tests/test_docs.py::test_docs_name_only_what_exists`, `layout.plan.ParallelPlan.for_world`, "
        "`config.json`, `model.named_parameters()`, `torch.utils.checkpoint` and Megatron-LM's "
        "[`examples/gpt3/train.sh`](https://github.com/NVIDIA/Megatron-LM) are fine.\n"
    )
    assert problems(str(doc), index) == [
        f"{doc}: ParallelPlan.no_such_method: no ParallelPlan.no_such_method",
        f"{doc}: megatron_p2r/layout/plan.py defines no no_such_thing",
        f"{doc}: megatron_p2r/p2r/sharing.py does not exist",
        f"{doc}: parallel.ddp.NoSuchClass: no megatron_p2r.parallel.ddp.NoSuchClass",
        f"{doc}: tests/parallel/test_state.py does not exist",
    ]


def _korthikanti_table(argv):
    from benchmarks import korthikanti_table

    korthikanti_table.main(argv)


def _checkpoint_cost(argv):
    from benchmarks import checkpoint_cost

    checkpoint_cost.main(argv)


def _memory_per_rank(argv):
    from benchmarks import memory_per_rank

    memory_per_rank.main(argv)


def _attention_shapes(argv):
    from benchmarks import attention_shapes

    attention_shapes.main(argv)


# (doc, the command written beside a table in it, its main, its arguments): commands of seconds
DOCUMENTED_OUTPUTS = [
    ("docs/attention.md", "python benchmarks/attention_shapes.py", _attention_shapes, []),
    ("docs/scale.md", "python benchmarks/korthikanti_table.py", _korthikanti_table, []),
    ("docs/scale.md", "python benchmarks/korthikanti_table.py --fits", _korthikanti_table, ["--fits"]),
    ("docs/scale.md", "python benchmarks/memory_per_rank.py --tables", _memory_per_rank, ["--tables"]),
    ("docs/checkpoint.md", "python benchmarks/checkpoint_cost.py", _checkpoint_cost, []),
]


@pytest.mark.parametrize("doc, command, main, argv", DOCUMENTED_OUTPUTS, ids=[c for _, c, _, _ in DOCUMENTED_OUTPUTS])
def test_documented_output_is_the_commands(doc, command, main, argv):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        text = fh.read()
    assert f"`{command}`" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    assert out.getvalue().strip() in text


def evidence_problems(doc: str, root: str = ROOT) -> List[str]:
    """The guide's last line names its evidence appendices, and they exist."""
    with open(os.path.join(root, doc), encoding="utf-8") as fh:
        lines = [line.strip() for line in fh.read().splitlines() if line.strip()]
    m = _EVIDENCE_LINE.match(lines[-1]) if lines else None
    if not m:
        return [f"{doc}: its last line is not 'Evidence: docs/evidence/<topic>.md'"]
    return [
        f"{doc}: {path} does not exist"
        for path in m.group(1).split(", ")
        if not os.path.isfile(os.path.join(root, path))
    ]


@pytest.mark.parametrize("doc", [d for d in guide_files() if d not in PENDING_GUIDES])
def test_every_guide_names_its_evidence(doc):
    assert evidence_problems(doc) == []


def test_the_readme_lists_every_guide():
    """One hop from the README to any feature: its Guides section has a line per guide."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        section = fh.read().split("\n## Guides\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- \[`(docs/[\w-]+\.md)`\]\(\1\)", section, re.M))
    assert set(guide_files()) - listed == set()


def test_pending_guides_are_guides():
    """A stale entry (renamed, removed) would hide nothing; keep the list true."""
    assert PENDING_GUIDES <= set(guide_files())


def test_the_evidence_check_sees_a_missing_line_and_a_missing_file(tmp_path):
    (tmp_path / "docs" / "evidence").mkdir(parents=True)
    (tmp_path / "docs" / "evidence" / "x.md").write_text("# x\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\nEvidence: docs/evidence/x.md\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n\nEvidence: docs/evidence/x.md, docs/evidence/y.md\n")
    (tmp_path / "docs" / "c.md").write_text("# C\n\nNo evidence here.\n")
    root = str(tmp_path)
    assert [evidence_problems(d, root) for d in guide_files(root)] == [
        [],
        ["docs/b.md: docs/evidence/y.md does not exist"],
        ["docs/c.md: its last line is not 'Evidence: docs/evidence/<topic>.md'"],
    ]


_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
_SHELL = {"bash", "sh", "shell", "console"}
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
# Scripts of other projects that a doc shows being run there (Megatron-LM's training script).
FOREIGN_SCRIPTS = {"pretrain_gpt.py"}


def _console_scripts(root: str) -> Set[str]:
    with open(os.path.join(root, "setup.py"), encoding="utf-8") as fh:
        return set(re.findall(r"[\"']([\w-]+)=[\w.]+:\w+[\"']", fh.read()))


def _make_targets(root: str) -> Set[str]:
    with open(os.path.join(root, "Makefile"), encoding="utf-8") as fh:
        return set(re.findall(r"^([\w-]+):", fh.read(), re.M))


def _module_exists(module: str, root: str) -> bool:
    path = os.path.join(root, *module.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def commands(text: str) -> Iterator[Tuple[List[str], bool]]:
    """The words of every line in the text's code blocks (continuations joined, a ``$`` prompt
    and leading ``NAME=value`` assignments dropped), and whether its block is a shell block."""
    for block in _FENCE.finditer(text):
        for line in block.group(2).replace("\\\n", " ").splitlines():
            words = line.split("#", 1)[0].split()
            if words and words[0] == "$":
                words = words[1:]
            while words and _ENV.match(words[0]):
                words = words[1:]
            if words:
                yield words, block.group(1) in _SHELL


def _script_problem(words: List[str], root: str) -> Optional[str]:
    """What is missing of the script or module a ``python``/``torchrun`` line runs."""
    runs = [i for i, w in enumerate(words) if w.endswith(".py") or w in ("-m", "-c")]
    if not runs or words[runs[0]] == "-c":
        return None
    i = runs[0]
    if words[i] == "-m":
        module = words[i + 1] if i + 1 < len(words) else ""
        external = module.split(".")[0] in ("pytest", "pip", "torch", "venv", "ruff")
        return None if external or _module_exists(module, root) else f"no module {module}"
    script = words[i]
    if script in FOREIGN_SCRIPTS or os.path.isfile(os.path.join(root, script)):
        return None
    return f"no script {script}"


def command_problems(doc: str, root: str = ROOT) -> List[str]:
    """Each line of a code block that runs python, torchrun, make or a ``p2r-*`` entry (or, in a
    shell block, a ``.py`` script) runs one that exists; other lines (output, flags, a file
    tree) are not commands."""
    with open(os.path.join(root, doc), encoding="utf-8") as fh:
        text = fh.read()
    entries, targets, found = _console_scripts(root), _make_targets(root), []
    for words, shell in commands(text):
        head = os.path.basename(words[0])
        if head.startswith("python") or head == "torchrun":
            problem = _script_problem(words[1:], root)
            if problem:
                found.append(f"{doc}: {head}: {problem}")
        elif (
            head == "make"
            and len(words) > 1
            and not words[1].startswith("-")
            and "=" not in words[1]
            and words[1] not in targets
        ):
            found.append(f"{doc}: make {words[1]}: no such target in the Makefile")
        elif (
            shell
            and words[0].endswith(".py")
            and words[0] not in FOREIGN_SCRIPTS
            and not os.path.isfile(os.path.join(root, words[0]))
        ):
            found.append(f"{doc}: {words[0]}: no such script")
        elif words[0].startswith("p2r-") and words[0] not in entries:
            found.append(f"{doc}: {words[0]}: no such console entry in setup.py")
    return sorted(set(found))


@pytest.mark.parametrize("doc", doc_files() + evidence_files())
def test_every_command_in_a_doc_exists(doc):
    assert command_problems(doc) == []


def test_the_command_check_sees_a_missing_script_module_target_and_entry(tmp_path):
    for name in ("setup.py", "Makefile"):
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            (tmp_path / name).write_text(fh.read())
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "plan.py").write_text("")
    (tmp_path / "guide.md").write_text(
        "```bash\n$ OMP_NUM_THREADS=1 python tools/no_such.py --x 1\ntorchrun --nproc-per-node 2 \\\n"
        "    no_such_entry.py --y\npython -m tools.no_such\nmake no-such-target\np2r-no-such --z\n"
        "convert.py delink A B\np2r-study --work w\npython tools/plan.py --help\npython -m tools.plan\n"
        "make test\n--flag-line only\ntorchrun ... pretrain_gpt.py --use-checkpoint-args\n```\n"
        "```\nlayer.py   MoELayer: a file tree, not a command\n```\n"
    )
    assert command_problems("guide.md", str(tmp_path)) == [
        "guide.md: convert.py: no such script",
        "guide.md: make no-such-target: no such target in the Makefile",
        "guide.md: p2r-no-such: no such console entry in setup.py",
        "guide.md: python: no module tools.no_such",
        "guide.md: python: no script tools/no_such.py",
        "guide.md: torchrun: no script no_such_entry.py",
    ]
