import json


from tests.helpers import bad_input_error
from tools.plot_logs import main, series


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plot_marks_the_phase_change(tmp_path):
    pseudo = _write(
        tmp_path / "p.jsonl",
        [
            {"iteration": i, "lm_loss": 5 - i * 0.1, "phase": "pseudo", "tokens": i * 10, "flops": i * 1e9}
            for i in (1, 2)
        ],
    )
    real = _write(
        tmp_path / "r.jsonl",
        [{"iteration": i, "lm_loss": 5 - i * 0.1, "phase": "real", "tokens": i * 10, "flops": i * 1e9} for i in (3, 4)],
    )
    from tools.plot_logs import read_records

    s = series(read_records([pseudo, real]), "lm_loss")
    assert s["iteration"] == [1, 2, 3, 4] and [r["iteration"] for r in s["delink"]] == [2]
    out = tmp_path / "loss.png"
    assert main(["--log-file", pseudo, real, "--output", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_bad_log_line_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1}\nnot json\n')
    assert "bad.jsonl:2: not a JSON line" in bad_input_error(
        main, ["--log-file", bad, "--output", tmp_path / "x.png"], capsys
    )
    bad.write_text('{"iteration": 1}\n[1, 2]\n')
    assert "bad.jsonl:2: expected a JSON object" in bad_input_error(
        main, ["--log-file", bad, "--output", tmp_path / "x.png"], capsys
    )
