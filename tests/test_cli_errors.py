"""Every ``vlmspec`` subcommand answers a user error with one line and a non-zero status, never a traceback."""

from __future__ import annotations

import pytest

from vlmspec.cli import main
from vlmspec.testing import make_video_frames, write_video


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors and explicit SystemExit messages
        code = stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=__import__("sys").stderr)
    return code, capsys.readouterr().err


@pytest.fixture
def user_files(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my own notes\n")
    videos = tmp_path / "videos"
    videos.mkdir()
    write_video(videos / "a.mp4", make_video_frames(0))
    saved = tmp_path / "saved"  # the settings of a pipeline saved with dsbd (no models needed to refuse it)
    saved.mkdir()
    (saved / "vlmspec_pipeline.yaml").write_text("policy: dsbd\npolicy_options: {}\n")
    return {"notes": notes, "videos": videos, "missing": tmp_path / "missing", "saved": saved}


CASES = [
    (["demo", "--image", "{missing}.png"], "does not exist"),
    (["demo", "--video", "{missing}.mp4"], "does not exist"),
    (["demo", "--target", "testbed-huge"], "did you mean 'testbed-base'"),
    (["demo", "--policy", "nope"], "unknown policy 'nope'"),
    (["demo", "--policy-options", "{{bad"], "is not valid JSON"),
    (["demo", "--policy-options", '{{"d_max": "8"}}'], "expected an integer, got str"),
    (["demo", "--policy-options", '{{"colour": 1}}'], "unknown option(s) ['colour']"),
    (["demo", "--pair", "nonsense"], "is not a pair name"),
    (["demo", "--policy", "dsbd"], "'dsbd' has no greedy form"),  # refused before the models load
    (["demo", "--target", "{saved}"], "'dsbd' has no greedy form (it decodes only with sampling"),
    (
        ["caption", "{videos}", "--out", "{missing}.jsonl", "--target", "testbed-mini", "--policy", "dsbd"],
        "and the caption job decodes greedily: use a lossless policy such as --policy sage",
    ),
    (["bench", "--methods", "sage,dsbd"], "--methods dsbd: the methods' rows decode greedily"),
    (["bench", "--tasks", "nope"], "nope"),
    (["bench", "--methods", "nope"], "unknown method(s) ['nope']"),
    (["bench", "--target", "testbed-huge", "--draft", "org/d"], "did you mean 'testbed-base'"),
    (["caption", "{missing}", "--out", "{notes}.jsonl", "--target", "testbed-mini"], "missing"),
    (["caption", "{videos}", "--out", "{notes}", "--target", "testbed-mini"], "was not written by this job"),
    (["c2t", "train", "--data", "{missing}.safetensors", "--out", "{missing}.out"], "missing"),
    (["testbed", "build", "--size", "huge"], "huge"),
    (["bench", "--methods", "edd+nope"], "unknown method(s) ['edd+nope']"),
    (
        ["edd", "train", "--target", "testbed-mini", "--data", "{missing}.jsonl", "--out", "{missing}"],
        "missing",
    ),
    (
        ["edd", "eval", "--target", "testbed-mini", "--draft", "{videos}", "--data", "testbed"],
        "is not an EDD draft",
    ),
    (["demo", "--target", "testbed-mini", "--draft", "edd"], "no EDD draft ships"),
    (["bench", "--throughput", "0"], "--throughput must be >= 1, got 0"),
    (["bench", "--out", "{notes}"], "notes.txt' is a file: give a folder"),
    (["demo", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["demo", "--choice", " , "], "structured_outputs.choice=[] is invalid"),  # before the models load
    (["demo", "--json-schema", "[1]"], "structured_outputs.json='[1]' is invalid"),
    (["demo", "--regex", "a", "--choice", "b"], "not allowed with argument --regex"),
    (["demo", "--json-schema", "{missing}.json"], "no such file (give a file or JSON text)"),
    (
        ["bench", "--methods", "chain", "--edd", "{videos}"],
        "is for the edd+<policy> rows, and --methods names none",
    ),
    (["bench", "--methods", "chain", "--prune-ratios", "0.5"], "which runs sage, and --methods has no sage"),
    (["bench", "--beam-width", "4"], "--beam-width (needs --dsbd): a flag that acts only beside another one"),
    (
        ["bench", "--throughput-policies", "chain"],
        "--throughput-policies (needs --throughput or --conversation)",
    ),
    (["bench", "--budget", "8", "--auto-factor", "3"], "--auto-factor (needs --budget auto)"),
    (["bench", "--auto-factor", "nan"], "auto factor=nan is invalid: use a finite number >= 1"),
    (["bench", "--json", "{notes}/r.json"], "notes.txt', a file: give a path in a folder"),
    (
        ["c2t", "train", "--data", "{notes}", "--out", "{notes}/c.safetensors"],
        "notes.txt', a file: give a path in a folder",
    ),
    (["c2t", "train", "--data", "{notes}", "--out", "{missing}", "--val-fraction", "5"], "got 5.0"),
    (
        ["c2t", "collect", "--tiny", "qwen2_vl", "--out", "{missing}", "--dtype", "bogus"],
        "torch_dtype='bogus'",
    ),
    (["edd", "train", "--target", "testbed-mini", "--data", "testbed", "--out", "{notes}"], "is a file"),
    (
        ["edd", "eval", "--target", "testbed-mini", "--draft", "edd", "--data", "testbed", "--block", "0"],
        "got 0",
    ),
    (["testbed", "build", "--root", "{notes}"], "notes.txt' is a file: give a folder"),
    (["bench", "--throughput", "1", "--json", "{notes}"], "does not honour --json"),
    (["bench", "--conversation", "--throughput", "1"], "does not honour --conversation"),
    (["bench", "--target", "testbed-mini", "--calibration", "nosuch"], "unknown calibration 'nosuch'"),
    (["bench", "--target", "testbed-mini", "--size", "base"], "--size base picks the default pair's size"),
]


@pytest.mark.parametrize(
    ("argv", "message"), CASES, ids=[" ".join(c[0][:2]) + f"-{i}" for i, c in enumerate(CASES)]
)
def test_a_user_error_is_one_line_without_traceback(argv, message, user_files, capsys):
    argv = [a.format(**user_files) for a in argv]
    code, err = run(argv, capsys)
    assert code != 0 and "Traceback" not in err, err
    assert message in err, err
    assert user_files["notes"].read_text() == "my own notes\n"  # the user's file is untouched


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="unknown policy"):
        main(["demo", "--policy", "nope", "--debug"])


BENCH_BAD_VALUES = [["--n", "0"], ["--repeats", "0"], ["--tasks", "nosuch"], ["--methods", "nosuch"],
                    ["--prune-ratios", "2"], ["--budget", "foo"], ["--throughput", "-1"]]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [["caption", "{videos}", "--bogus"], ["demo", "--nope"], ["bench", "--n", "zero"], ["testbed", "build", "--size", "huge"],
     ["c2t", "train", "--epochs", "x", "--data", "a", "--out", "b"], ["edd", "train"]]
    + [["bench", *values] for values in BENCH_BAD_VALUES],
)  # fmt: skip
def test_a_bad_flag_exits_1_not_the_jobs_partial_status_2(argv, user_files, capsys):
    code, err = run([a.format(**user_files) for a in argv], capsys)
    assert code == 1 and "error:" in err and "Traceback" not in err, (code, err)
    assert len(err.strip().splitlines()) == 1, err  # one line, no usage block
