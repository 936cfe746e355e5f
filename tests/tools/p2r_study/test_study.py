"""The study on a user's corpus: options, data from a jsonl and from .bin/.idx, the held-out set
and its per-sample losses, and a tiny study that resumes without retraining."""

import argparse
import glob
import json
import os

import pytest

from tools.p2r_study import arms as p2r_arms, cli, corpus as p2r_corpus
from tools.p2r_study.heldout import HeldOutTooSmall, held_out_set, mean_se, per_sample_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of liquid".split()
TINY = [
    "--tokenizer-type",
    "ByteTokenizer",
    "--model",
    "t=2x16",
    "--iters",
    "8",
    "--eval-interval",
    "4",
    "--seq",
    "16",
    "--micro-batch",
    "2",
    "--eval-samples",
    "8",
    "--seeds",
    "1",
    "--grow-factors",
    "2",
    "--grow-at",
    "0.5",
    "--p2r-at",
    "0.5",
    "--timing-rounds",
    "0",
    "--jobs",
    "1",
]


def _jsonl(path, docs=40, words=60):
    with open(path, "w") as fh:
        for d in range(docs):
            fh.write(json.dumps({"text": " ".join(WORDS[(d * 7 + i * 3) % len(WORDS)] for i in range(words))}) + "\n")
    return str(path)


def _corpus_args(**values):
    base = dict(
        data_path=None,
        tokenizer_type="ByteTokenizer",
        tokenizer_model=None,
        valid_data_path=None,
        valid_fraction=0.1,
        corpus_bytes=0,
        demo_source="code",
        held_out="tail",
        held_out_seed=1234,
    )
    return argparse.Namespace(**dict(base, **values))


def test_default_arms_are_todays_plus_controls():
    deep = p2r_arms.build_arms(
        p2r_arms.Shape(24, 64), p2r_arms.DEFAULT_ARMS["deep"], [0.1], [0.25], [4], flops_per_token=float
    )  # FLOPs proportional to layers
    assert list(deep) == [
        "real from scratch",
        "P2R at 10%",
        "P2R at 10%, noise + re-warm-up",
        "progressive all→cycle:4→none",
        "grow ×4 (stack) at 25%",
        "scratch decayed at the FLOPs of grow ×4 (stack) at 25%",
    ]
    # 25% of the run at 6 of 24 layers, 75% at 24: 0.25 / 4 + 0.75 of scratch's FLOPs
    assert deep["scratch decayed at the FLOPs of grow ×4 (stack) at 25%"] == [p2r_arms.Phase(0.8125)]
    wide = p2r_arms.build_arms(
        p2r_arms.Shape(8, 128), p2r_arms.DEFAULT_ARMS["wide"], [0.1], [0.1, 0.25, 0.5], [2, 4], flops_per_token=float
    )
    assert "grow ×4 (stack) at 10%" in wide and "grow ×2 (stack) at 50%" in wide and len(wide) == 2 + 6 + 6
    assert p2r_arms.parse_shape("deep=24x64@12MiB") == ("deep", p2r_arms.Shape(24, 64, "12MiB"))


@pytest.mark.parametrize(
    "options, message",
    [
        (["--model", "t=3x10"], "--model 't=3x10': needs at least one layer and a hidden size that is a multiple"),
        (["--model", "t:3x16"], "expected NAME=LAYERSxHIDDEN[@BUDGET]"),
        (["--models", "huge"], "--models huge: no such shape; the shapes are deep, wide"),
        (["--iters", "0"], "--iters must be at least 1"),
    ],
)
def test_bad_options_are_one_error_line(tmp_path, capsys, options, message):
    assert cli.main(["--work", str(tmp_path), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not os.listdir(tmp_path)  # refused before any data is prepared


def test_corpus_from_jsonl_and_from_prefix(tmp_path):
    data = _jsonl(tmp_path / "c.jsonl")
    corpus = p2r_corpus.prepare(_corpus_args(data_path=data), str(tmp_path / "w"))
    assert corpus.train_prefix == str(tmp_path / "w" / "train_text_document") and corpus.split == "0.9,0.1,0"
    assert corpus.valid_prefix == corpus.train_prefix and corpus.valid_docs == (36, 40)  # the last 10% of 40
    again = p2r_corpus.prepare(_corpus_args(data_path=corpus.train_prefix), str(tmp_path / "w2"))
    assert again.train_prefix == corpus.train_prefix and not os.path.exists(tmp_path / "w2" / "train_text_document.idx")
    held = p2r_corpus.prepare(
        _corpus_args(data_path=corpus.train_prefix, valid_data_path=_jsonl(tmp_path / "v.jsonl", docs=5)),
        str(tmp_path / "w3"),
    )
    assert held.split == "100,0,0" and held.valid_prefix.endswith("valid_text_document") and held.valid_docs == (0, 5)
    with pytest.raises(p2r_corpus.CorpusError, match="missing.bin not found: a data path is a .bin/.idx prefix"):
        p2r_corpus.prepare(_corpus_args(data_path=str(tmp_path / "missing")), str(tmp_path / "w4"))
    with pytest.raises(p2r_corpus.CorpusError, match="tokenised already: give its --tokenizer-type"):
        p2r_corpus.prepare(_corpus_args(data_path=corpus.train_prefix, tokenizer_type=None), str(tmp_path / "w5"))
    # documents 36..39 hold 1,258 tokens: (1258 - 1) // 16 = 78 windows of 17 tokens that do not repeat
    assert len(held_out_set(corpus.train_prefix, corpus.valid_docs, 78, 16, str(tmp_path / "cache"))) >= 78
    with pytest.raises(HeldOutTooSmall, match="documents 36..39 of .* hold 1,258 tokens, 78 samples of 16 tokens"):
        held_out_set(corpus.train_prefix, corpus.valid_docs, 79, 16, str(tmp_path / "cache"))


def test_per_sample_losses_average_to_the_trainers_eval_loss(tmp_path):
    """Samples of equal length: the mean of per-sample means is the token mean evaluate() reports."""
    from megatron_p2r.arguments import config_from_values
    from megatron_p2r.parallel.state import ParallelState
    from megatron_p2r.training import build_train_state, evaluate, resolve_vocab

    corpus = p2r_corpus.prepare(_corpus_args(data_path=_jsonl(tmp_path / "c.jsonl")), str(tmp_path / "w"))
    held = held_out_set(corpus.train_prefix, corpus.valid_docs, 6, 16, str(tmp_path / "cache"))
    cfg = resolve_vocab(
        config_from_values(
            dict(
                num_layers=1,
                hidden_size=16,
                num_attention_heads=4,
                seq_length=16,
                micro_batch_size=2,
                eval_iters=3,
                tokenizer_type="ByteTokenizer",
                data_path=[corpus.train_prefix],
            )
        )
    )
    state = build_train_state(cfg, ParallelState.single())
    losses = per_sample_losses(state.model, held, 6, batch=4)
    assert len(losses) == 6 and len(set(losses)) == 6
    assert mean_se(losses)[0] == pytest.approx(evaluate(state, held), rel=1e-6)


def _trained(work):
    """Each finished phase's and conversion's result file, with its modification time."""
    files = glob.glob(f"{work}/runs/**/evals.json", recursive=True) + glob.glob(
        f"{work}/runs/**/after.json", recursive=True
    )
    return {f: os.stat(f).st_mtime_ns for f in files}


def _checkout():
    """The checkout's top level and docs/, with modification times: a study must leave them alone."""
    return {
        p: os.stat(p).st_mtime_ns
        for p in glob.glob(os.path.join(ROOT, "*")) + glob.glob(os.path.join(ROOT, "docs", "*"))
    }


@pytest.mark.slow
def test_tiny_study_from_another_directory_resumes_and_writes_only_under_work(tmp_path, capsys, monkeypatch):
    """Issue 38, bug 3: relative paths are the caller's, the helper tools and workers run in the
    caller's directory, and the report goes under --work, never into the checkout's docs/."""
    monkeypatch.chdir(tmp_path)
    before = _checkout()
    _jsonl(tmp_path / "c.jsonl")
    work, out = str(tmp_path / "w"), str(tmp_path / "w" / "report")
    study = ["--data-path", "c.jsonl", "--valid-fraction", "0.2", *TINY, "--work", "w"]
    # a study stopped after its P2R arms ...
    assert cli.main(study + ["--arms", "p2r"]) == 0
    first = _trained(work)
    assert len(glob.glob(f"{work}/records/*.json")) == 2 and len(first) == 4  # scratch; pseudo, delink, real
    # ... continues with the growth arm and its control, retraining nothing it finished
    assert cli.main(study + ["--arms", "p2r", "grow", "matched"]) == 0
    second = _trained(work)
    assert {f: second[f] for f in first} == first and len(second) == len(first) + 4  # small, growth, real; control
    assert "4 runs (1 models x arms x 1 seeds), 2 done before" in capsys.readouterr().out
    records = {json.load(open(p))["arm"]: json.load(open(p)) for p in glob.glob(f"{work}/records/*.json")}
    control = records["scratch decayed at the FLOPs of grow ×2 (stack) at 50%"]
    assert control["phases"][0]["end"] == 7 and all(len(p) == 3 for p in control["points"])  # [step, loss, SE]
    assert len(control["final_losses"]) == 8
    # killed after a run's phases but before its record: run again, nothing is trained, the record is rebuilt
    grow_record = [
        p
        for p in glob.glob(f"{work}/records/*.json")
        if "grow" in json.load(open(p))["arm"] and "scratch" not in json.load(open(p))["arm"]
    ]
    os.remove(grow_record[0])
    assert cli.main(study + ["--arms", "p2r", "grow", "matched"]) == 0
    assert _trained(work) == second and os.path.exists(grow_record[0])
    report = open(os.path.join(out, "p2r_study.md")).read()
    assert "| grow ×2 (stack) at 50% | 1 |" in report and "FLOPs of a last-step crossing" in report
    assert "8 samples of 16 tokens from 8 documents drawn at random (seeded)" in report
    command = report.split("`")[1]  # reproducible anywhere: no --work, --out or --jobs of this machine
    assert command.startswith("p2r-study --data-path c.jsonl ") and "--iters 8" in command
    assert not any(flag in command for flag in ("--work", "--out", "--jobs"))
    # the same --work with other training settings is refused, naming what changed
    assert cli.main(study + ["--lr", "0.01"]) == 2
    assert "holds a study with other settings (lr 0.002 -> 0.01)" in capsys.readouterr().err
    assert _checkout() == before and not os.path.exists(os.path.join(ROOT, "w"))
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "w"]
    _check_report(report, str(tmp_path))


def _check_report(report: str, tmp: str) -> None:
    """Issue 38, the report read by a user: three SEs and the rule the verdict uses, a verdict line
    per claim with its seed count, controls' costs not presented as findings, no "± 0.000" for a
    value the seeds share, no path of this machine."""
    assert "SE of Δ: held-out samples | SE of Δ: documents | SE of Δ: seeds" in report
    assert "**Which SE the verdict uses.**" in report
    assert "- t, **grow ×2 (stack) at 50%** against its compute-matched control: final held-out loss" in report
    assert "- t, **P2R at 50%** against real from scratch: final held-out loss" in report
    assert " of 1 seeds, by more than 2 document SEs in " in report
    control_row = next(line for line in report.splitlines() if line.startswith("| scratch decayed at"))
    assert "never reach" not in control_row and "(a control)" in control_row
    assert "± 0.000" not in report and "± 0.00 " not in report
    assert tmp not in report and "**c.jsonl**" in report
    assert "held-out loss minus real from scratch's" in report and "jump at each growth" in report
