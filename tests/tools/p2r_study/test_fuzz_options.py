"""The study's options under the project's fuzz harness (tests/reliability/fuzz_support.py): every
generated command line ends in exit 0 or in exit 2 with one ``error:`` line, never a traceback,
and touches nothing outside its case directory (issue 38: "the fuzzer extended to the study's
options"). Each case already holds a finished-looking ``--work`` (a stray record), so the
options are carried through the corpus step, the tokenizer and the held-out set, not refused at
``--report-only``'s first check; no case trains.
"""

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_p2r.data.indexed_dataset import IndexedDatasetBuilder
from tests.reliability import fuzz_support as fz
from tools.p2r_study import cli

CATEGORY = "p2r-study options"
PATHS = ["ds", "c.jsonl", "missing", "", ".", "c.jsonl/x", "sub", "ds.bin", "~", "w"]
NUMBERS = ["0", "-1", "1", "2", "3", "1e9", "0.5", "nan", "x", "4x"]
OPTIONS = {
    "--data-path": PATHS,
    "--valid-data-path": PATHS,
    "--tokenizer-model": PATHS,
    "--tokenizer-type": ["ByteTokenizer", "NullTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "x"],
    "--valid-fraction": NUMBERS,
    "--held-out": ["documents", "tail", "x"],
    "--held-out-seed": NUMBERS,
    "--eval-samples": NUMBERS,
    "--seq": NUMBERS,
    "--micro-batch": NUMBERS,
    "--iters": NUMBERS,
    "--eval-interval": NUMBERS,
    "--lr": NUMBERS,
    "--jobs": NUMBERS,
    "--seeds": NUMBERS,
    "--model": ["t=2x16", "t=0x16", "t=2x10", "x", "t=2x16@1MiB", "t=4x16"],
    "--models": ["t", "deep", "x"],
    "--arms": ["p2r", "grow", "matched", "x"],
    "--p2r-at": NUMBERS,
    "--grow-at": NUMBERS,
    "--grow-factors": NUMBERS,
    "--out": PATHS,
    "--name": ["r", "", "../r", "a/b"],
    "--work": PATHS,
}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A case directory: a prefix ``ds``, a jsonl, a sub directory, and a --work ``w`` with a record."""
    root = tmp_path_factory.mktemp("study_fuzz")
    case = root / "template"
    os.makedirs(case / "sub")
    os.makedirs(case / "w" / "records")
    (case / "w" / "records" / "stray.json").write_text("{}")
    b = IndexedDatasetBuilder(str(case / "ds.bin"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(60):
        b.add_document(rng.integers(0, 250, rng.integers(20, 80)))
    b.finalize(str(case / "ds.idx"))
    with open(case / "c.jsonl", "w") as fh:
        for d in range(30):
            fh.write(json.dumps({"text": f"document {d} " * 20}) + "\n")
    yield {"root": str(root), "case": str(case), "rss_bound": fz.start()}
    shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_study_options(template, data):
    case = fz.fresh_dir(template["root"], CATEGORY, template["case"])
    argv = [
        "--work",
        "w",
        "--report-only",
        "--timing-rounds",
        "0",
        "--data-path",
        "ds",
        "--tokenizer-type",
        "ByteTokenizer",
        "--model",
        "t=2x16",
        "--seq",
        "16",
        "--eval-samples",
        "4",
    ]
    for option in data.draw(st.lists(st.sampled_from(sorted(OPTIONS)), min_size=1, max_size=3)):
        argv += [option, data.draw(st.sampled_from(OPTIONS[option]))]
    fz.run_case(CATEGORY, case, cli.main, argv, template["rss_bound"])
