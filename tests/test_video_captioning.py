"""Batch video captioning (``pipelines/video_captioning.py``, ``vlmspec caption``): nothing lost, resumable, sharded.

The model pair is the fixture ``caption_pair``: the testbed's trained ``mini`` qwen2_vl pair (trained once,
about 2 minutes on 2 CPU cores, then cached under ``VLMSPEC_CACHE``). Videos are testbed clips (held-out seeds)
written with ``write_video``. Generation is greedy and short (16 tokens), with one torch thread, so reruns give equal captions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vlmspec_caption
from job_forks import JobForks
from vlmspec_caption import store

from vlmspec import InvalidInputError, VLMSpecPipeline, testbed
from vlmspec.testing import write_video

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "pipelines" / "video_captioning.py"
COMMON = ["--max-new-tokens", "16", "--num-frames", "4", "--threads", "1", "--no-progress"]
TIMEOUT = 240
SLOW_SETUP = (
    "import time\n"
    "import vlmspec_caption\n"
    "from vlmspec.pipeline import VLMSpecPipeline\n"
    "results = VLMSpecPipeline.batch_iter\n"
    "def slow(self, *a, **k):\n"
    "    for result in results(self, *a, **k):\n"
    "        yield result\n"
    "        time.sleep(0.4)\n"
    "VLMSpecPipeline.batch_iter = slow\n"
)
"""The job's imports, and 0.4 s between captions (the job waits that long after writing each line, whatever its
batch size), so a kill lands mid-run. Run once in a fork server (``slow_job``): each run of the job is forked from
it, past the imports, so a kill lands in the job itself, never in Python's start-up."""


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vc():
    """The job package (``pipelines/vlmspec_caption``, installed with vlmspec)."""
    return vlmspec_caption


@pytest.fixture(scope="module")
def slow_job():
    """Runs of the job slowed down by ``SLOW_SETUP``, forked from one interpreter (``job_forks.JobForks``)."""
    with JobForks(SLOW_SETUP, _env()) as forks:
        yield forks


@pytest.fixture(scope="session")
def caption_pair() -> tuple[Path, Path]:
    """(target, draft): the testbed mini qwen2_vl pair (trained once, about 2 minutes, then cached)."""
    return tuple(Path(p) for p in testbed.pair_paths(size="mini", family="qwen2_vl"))


def _clip(seed: int) -> list:
    return testbed.sample("video_caption", seed).video


def _write_clips(folder: Path, count: int, prefix: str = "clip") -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        write_video(folder / f"{prefix}{i}.mp4", _clip(500 + i))
        names.append(f"{prefix}{i}.mp4")
    return names


@pytest.fixture(scope="module")
def six_videos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("six") / "videos"
    _write_clips(folder, 6)
    return folder


@pytest.fixture(scope="module")
def reference(vc, caption_pair, six_videos, tmp_path_factory) -> dict[str, str]:
    """Captions of a clean single-process run over ``six_videos`` (id -> caption)."""
    out = tmp_path_factory.mktemp("ref") / "captions.jsonl"
    code = vc.main([str(six_videos), "--out", str(out), *_pair_args(caption_pair), *COMMON])
    assert code == 0
    records = _records(out)
    assert [r["id"] for r in records] == [f"clip{i}.mp4" for i in range(6)]
    return {r["id"]: r["caption"] for r in records}


def _pair_args(pair: tuple[Path, Path]) -> list[str]:
    return ["--target", str(pair[0]), "--draft", str(pair[1])]


def _records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the output must end with a whole line"
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance: partial failures, kill + resume, two processes, job errors
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_videos_get_error_lines_and_exit_2(vc, caption_pair, tmp_path, capsys):
    folder = tmp_path / "mixed"
    good = _write_clips(folder, 3, prefix="good")
    (folder / "corrupt.mp4").write_bytes(os.urandom(4096))
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "notes.txt").write_text("not a video")  # not a video extension: not an input
    out = tmp_path / "captions.jsonl"
    args = [str(folder), "--out", str(out), *_pair_args(caption_pair), *COMMON]

    assert vc.main(args) == vc.EXIT_PARTIAL
    records = {r["id"]: r for r in _records(out)}
    assert sorted(records) == sorted([*good, "corrupt.mp4", "empty.mp4"])
    for name in good:
        assert records[name]["caption"] and "error" not in records[name]
        assert records[name]["stats"]["new_tokens"] > 0 and "trace" not in records[name]["stats"]
        assert records[name]["settings"]["max_new_tokens"] == 16 and records[name]["policy"] == "sage"
    corrupt, empty = records["corrupt.mp4"], records["empty.mp4"]
    assert "caption" not in corrupt and "could not be decoded" in corrupt["error"]
    assert corrupt["error_type"] == "ValueError" and corrupt["path"].endswith("corrupt.mp4")
    assert "empty" in empty["error"] and empty["error_type"] == "ValueError"
    assert "3 succeeded, 2 failed" in capsys.readouterr().out

    # Restart: error lines are retried by default (still failing: still one line each), or kept with the flag.
    before = out.read_bytes()
    assert vc.main([*args, "--no-retry-errors"]) == vc.EXIT_PARTIAL
    assert out.read_bytes() == before
    assert "0 captioned, 0 failed, 5 already done" in capsys.readouterr().out
    assert vc.main(args) == vc.EXIT_PARTIAL
    assert sorted(r["id"] for r in _records(out)) == sorted(records)
    assert "0 captioned, 2 failed, 3 already done" in capsys.readouterr().out


def test_resuming_with_other_settings_warns_and_the_summary_names_who_made_the_lines(
    vc, caption_pair, tmp_path, capsys
):
    """Lines made with other settings are kept and skipped with a warning, also when nothing is left to do, and the
    summary never claims this run's settings for lines it did not make."""
    folder = tmp_path / "videos"
    _write_clips(folder, 2)
    out = tmp_path / "captions.jsonl"
    base = [str(folder), "--out", str(out), *_pair_args(caption_pair), *COMMON]
    sage = vc.run_meta(vc.load_config(None, vc.overrides_from_args(vc.build_parser().parse_args(base))))
    assert sage["policy"] == "sage" and sage["settings"]["max_new_tokens"] == 16  # nothing loaded for this
    out.write_bytes(vc.encode_record({"id": "clip0.mp4", "path": "p", "prompt": "q", "caption": "c", **sage}))
    chain = [*base, "--max-new-tokens", "5", "--policy", "chain"]

    assert vc.main(chain) == 0  # clip1 captioned with chain, clip0 kept
    captured = capsys.readouterr()
    assert "warning: 1 video(s) already captioned in the output used other models or settings" in captured.err
    assert "(policy sage; differing: max_new_tokens, policy)" in captured.err
    assert (
        "| policy chain; 1 of 2 lines from an earlier run with other settings (policy sage;" in captured.out
    )
    records = _records(out)
    assert [(r["id"], r["policy"]) for r in records] == [("clip0.mp4", "sage"), ("clip1.mp4", "chain")]

    before = out.read_bytes()
    assert vc.main(chain) == 0  # everything done: the same warning, the same summary
    captured = capsys.readouterr()
    assert "0 to caption" in captured.err and "warning: 1 video(s) already captioned" in captured.err
    assert "1 of 2 lines from an earlier run with other settings" in captured.out
    assert out.read_bytes() == before

    out.write_bytes(before.splitlines(keepends=True)[0])  # only the sage line: every line from an earlier run
    with open(out, "ab") as handle:
        handle.write(vc.encode_record({**records[1], **sage}))
    assert vc.main(chain) == 0
    captured = capsys.readouterr()
    assert "warning: 2 video(s) already captioned" in captured.err
    assert "| policy chain |" not in captured.out
    assert (
        "every line from an earlier run with other settings (policy sage; differing: max_new_tokens, policy), "
        "none with this run's (policy chain)" in captured.out
    )
    assert vc.main(base) == 0  # the settings that made the lines: no warning, the plain summary
    captured = capsys.readouterr()
    assert "warning" not in captured.err and "| policy sage |" in captured.out


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", ["1", "8"])
def test_killed_job_resumes_without_loss_or_duplicates(
    vc, caption_pair, six_videos, reference, tmp_path, batch_size, slow_job, capsys
):
    out = tmp_path / "captions.jsonl"
    argv = [
        str(six_videos),
        "--out",
        str(out),
        *_pair_args(caption_pair),
        *COMMON,
        "--batch-size",
        batch_size,
    ]
    # The first run is slowed down (0.4 s per video, in the child only) so that it is surely killed part-way.
    child = slow_job.start([str(SCRIPT), *argv], tmp_path / "first-run.log", TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert child.poll() is None, child.output()[-3000:]
        assert time.monotonic() < deadline, "the job wrote no line in time"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL
    done = out.read_bytes().count(b"\n")
    assert 1 <= done < 6, "the job must be killed part-way"
    with open(out, "ab") as handle:  # what a kill in the middle of a write would leave: a torn last line
        handle.write(b'{"id": "clip5.mp4", "path": "vid')

    assert vc.main(argv) == 0  # the resumed run, in this process (the clean run's captions were made so)
    resumed = capsys.readouterr()
    assert "torn last line" in resumed.err
    assert f"{done} already done" in resumed.out
    records = _records(out)  # every line parses
    ids = [r["id"] for r in records]
    assert ids == [f"clip{i}.mp4" for i in range(6)]  # every video exactly once, in input order
    assert {r["id"]: r["caption"] for r in records} == reference


@pytest.mark.slow
def test_killed_ten_times_with_every_signal_still_captions_each_video_once(
    vc, caption_pair, six_videos, reference, tmp_path, slow_job
):
    """Killed at random points 10 times in a row (kill -9, SIGTERM, Ctrl-C in turn), each time started again on
    the same output: the last run finishes, every video is there exactly once, with the clean run's caption."""
    import random

    out = tmp_path / "captions.jsonl"
    job = [str(SCRIPT), str(six_videos), "--out", str(out), *_pair_args(caption_pair), *COMMON]
    rng = random.Random(0)
    signals = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT]
    killed_mid_run = 0
    for round_ in range(10):
        before = _line_count(out)
        child = slow_job.start(job, tmp_path / f"round-{round_}.log", TIMEOUT)
        # A random point once the job runs: while loading, or just after one more caption is written (never all six
        # in 10 rounds). Not during Python's imports (the child starts past them): transformers may turn a Ctrl-C
        # there into an error.
        wanted = before + rng.choice([0, 0, 1])
        deadline = time.monotonic() + TIMEOUT
        while _line_count(out) < wanted and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        if child.poll() is None:
            killed_mid_run += 1
            os.kill(child.pid, signals[round_ % 3])
        child.wait(timeout=TIMEOUT)
        err = child.log.read_bytes()
        # Once the job runs, a signal ends it without a traceback (or it dies of the signal). A Ctrl-C that lands in
        # an object's __del__ is reported and swallowed by Python itself ("Exception ignored in"): the job goes on.
        err = re.sub(rb"Exception ignored in.*?\nKeyboardInterrupt: ?\n", b"", err, flags=re.S)
        assert b"Traceback" not in err or child.returncode < 0, err.decode()[-2000:]
        data = out.read_bytes() if out.exists() else b""
        ids = [json.loads(line)["id"] for line in data.splitlines(keepends=True) if line.endswith(b"\n")]
        assert len(ids) == len(set(ids)), f"round {round_}: a video written twice"
    assert vc.main(job[1:]) == 0  # the last run, in this process, finishes the job
    records = _records(out)
    assert sorted(r["id"] for r in records) == sorted(reference)  # every video exactly once
    assert {r["id"]: r["caption"] for r in records} == reference
    assert killed_mid_run >= 8, f"only {killed_mid_run} of 10 rounds were killed while the job ran"


@pytest.mark.slow
def test_two_processes_match_one(caption_pair, six_videos, reference, tmp_path):
    launcher = Path(sys.executable).parent / "accelerate"
    if not launcher.exists():
        pytest.skip("accelerate's launcher is not installed")
    out = tmp_path / "captions.jsonl"
    # On a CPU-only machine accelerate starts two processes with --multi_gpu and ACCELERATE_USE_CPU=1
    # (`--cpu --num_processes 2` starts only one there: multi-CPU launches go through mpirun).
    command = [
        str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
        str(SCRIPT), str(six_videos), "--out", str(out), *_pair_args(caption_pair), *COMMON,
    ]  # fmt: skip
    env = {**_env(), "ACCELERATE_USE_CPU": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process 0 of 2" in result.stderr and "process 1 of 2" in result.stderr
    assert "6 succeeded, 0 failed" in result.stdout
    assert not list(tmp_path.glob("captions.jsonl.part*")), "the part files are merged and removed"
    records = _records(out)
    assert [r["id"] for r in records] == [f"clip{i}.mp4" for i in range(6)]
    assert {r["id"]: r["caption"] for r in records} == reference


def test_the_summary_rate_counts_only_captioned_videos(vc):
    failed_only = vc.JobSummary(2, 0, 2, 0, vc.run.RunTotals(processed=2, failed=2, seconds=0.5), "sage", "o")
    assert failed_only.to_dict()["videos_per_second"] == 0.0
    assert "0.00 captioned videos/s" in failed_only.line()
    half = vc.run.RunTotals(processed=2, captioned=1, failed=1, new_tokens=8, seconds=2.0)
    summary = vc.JobSummary(2, 1, 1, 0, half, "sage", "o")
    assert summary.to_dict()["videos_per_second"] == 0.5 and "0.50 captioned videos/s" in summary.line()


def test_job_errors_exit_1(vc, caption_pair, tmp_path, capsys):
    out = str(tmp_path / "captions.jsonl")
    missing = tmp_path / "no-such-folder"
    assert vc.main([str(missing), "--out", out, *COMMON]) == vc.EXIT_JOB_ERROR
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err

    videos = tmp_path / "videos"
    _write_clips(videos, 1)
    config = tmp_path / "job.yaml"
    config.write_text("max_new_tokens: 8\nbogus_key: 1\n")
    assert vc.main([str(videos), "--out", out, "--config", str(config)]) == vc.EXIT_JOB_ERROR
    err = capsys.readouterr().err
    assert "unknown key(s) 'bogus_key'" in err and "valid keys: target, draft" in err and str(config) in err

    manifest = tmp_path / "list.jsonl"
    manifest.write_text('{"path": "videos/clip0.mp4"}\n{not json\n')
    assert vc.main([str(manifest), "--out", out, *COMMON]) == vc.EXIT_JOB_ERROR
    assert "line 2 is not valid JSON" in capsys.readouterr().err

    nowhere = tmp_path / "no-model"
    assert (
        vc.main([str(videos), "--out", out, "--target", str(nowhere), "--draft", str(nowhere), *COMMON]) == 1
    )
    assert f"target model folder {str(nowhere)!r} does not exist" in capsys.readouterr().err
    assert vc.main([str(videos), "--out", out, "--target", str(nowhere), *COMMON]) == 1  # no draft either
    assert (
        f"target model folder {str(nowhere)!r} does not exist" in capsys.readouterr().err
    )  # not "needs a draft"

    assert vc.main([str(videos), "--out", out, "--max-new-tokens", "0"]) == vc.EXIT_JOB_ERROR
    assert "command line: --max-new-tokens must be >= 1, got 0" in capsys.readouterr().err  # the flag's name
    bad_flags = {
        ("--max-pixels", "10"): "--max-pixels must be at least 1024 (one merged 32 x 32 patch), got 10",
        (
            "--frame-sampler",
            "qwen",
            "--num-frames",
            "1",
        ): "--num-frames must be >= 2 with the qwen frame sampler",
        ("--frame-sampler", "decord", "--fps", "2"): "--fps is the qwen frame sampler's",
        ("--config", str(videos)): "is a folder: give the YAML file itself",
    }
    for flags, message in bad_flags.items():  # refused before any video, not once per video
        assert vc.main([str(videos), "--out", out, *flags]) == vc.EXIT_JOB_ERROR
        assert message in capsys.readouterr().err
    assert not Path(out).exists() or Path(out).read_bytes() == b""


def test_vlmspec_caption_entry_point(tmp_path, capsys):
    assert vlmspec_caption.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o.jsonl")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_every_entry_point_takes_the_same_arguments_debug_included(vc, tmp_path, monkeypatch, capsys):
    import argparse

    from vlmspec.cli import build_parser as vlmspec_parser
    from vlmspec.cli import main as vlmspec_main

    def options(parser: argparse.ArgumentParser) -> list[str]:
        return sorted(s for action in parser._actions for s in action.option_strings)

    commands = next(a for a in vlmspec_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert options(commands.choices["caption"]) == options(vc.build_parser())
    assert "--debug" in options(vc.build_parser())

    missing = str(tmp_path / "missing")
    for command in ([sys.executable, "-m", "vlmspec_caption"], [sys.executable, str(SCRIPT)]):
        result = subprocess.run(
            [*command, missing, "--out", str(tmp_path / "o.jsonl"), "--debug"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert result.returncode == 1 and "does not exist" in result.stderr, result.stderr[-2000:]
        assert "unrecognized arguments" not in result.stderr
    assert vlmspec_main(["caption", missing, "--out", str(tmp_path / "o.jsonl"), "--debug"]) == 1
    assert "does not exist" in capsys.readouterr().err

    # An unexpected bad-input error: one line without --debug (as `vlmspec caption`), its traceback with it.
    def broken(*args, **kwargs):
        raise ValueError("a library below said no")

    monkeypatch.setattr(vc.cli, "run_job", broken)
    monkeypatch.delenv("VLMSPEC_DEBUG", raising=False)
    args = [missing, "--out", str(tmp_path / "o.jsonl")]
    assert vc.main(args) == vc.EXIT_JOB_ERROR
    assert "error: a library below said no (--debug shows the traceback)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a library below said no"):
        vc.main([*args, "--debug"])


# ---------------------------------------------------------------------------------------------------------------------
# qwen-vl-utils frame sampling, manifests, config
# ---------------------------------------------------------------------------------------------------------------------
def test_qwen_frame_sampler(vc, caption_pair, tmp_path):
    folder = tmp_path / "videos"
    _write_clips(folder, 2)
    (folder / "broken.mp4").write_bytes(os.urandom(2048))
    out = tmp_path / "captions.jsonl"
    qwen = ["--fps", "4", "--max-frames", "4", "--min-pixels", "3136", "--max-pixels", "12544"]
    args = [str(folder), "--out", str(out), *_pair_args(caption_pair), *COMMON, *qwen]
    assert vc.main(args) == vc.EXIT_PARTIAL
    records = {r["id"]: r for r in _records(out)}
    assert records["clip0.mp4"]["caption"] and records["clip1.mp4"]["caption"]
    assert records["clip0.mp4"]["settings"]["frame_sampler"] == "qwen"
    assert records["clip0.mp4"]["settings"]["max_pixels"] == 12544
    assert "could not be decoded" in records["broken.mp4"]["error"]  # not qwen-vl-utils' AttributeError


def test_a_max_pixels_below_qwen_vl_utils_frame_minimum_lowers_it(tmp_path):
    from vlmspec_caption.inputs import qwen_frames

    (clip,) = _write_clips(tmp_path, 1)
    frames = qwen_frames(tmp_path / clip, fps=1.0, max_pixels=50176)  # the package docstring's example
    assert frames and all(f.width * f.height <= 50176 for f in frames)
    assert all(
        f.width * f.height >= 3136
        for f in qwen_frames(tmp_path / clip, fps=1.0, min_pixels=3136, max_pixels=50176)
    )


def test_manifests_with_prompts_and_ids(vc, tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.mp4", "sub/b.MP4", ".hidden.mp4", "c.txt"):
        (tmp_path / name).write_bytes(b"x")
    items = vc.discover_inputs(tmp_path)
    assert [(i.id, i.prompt) for i in items] == [("a.mp4", None), ("sub/b.MP4", None)]

    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"path": "a.mp4", "prompt": "What moves?", "id": 7}\n\n{"video": "sub/b.MP4"}\n')
    items = vc.discover_inputs(manifest)
    assert [(i.id, i.path, i.prompt) for i in items] == [
        ("7", str(tmp_path / "a.mp4"), "What moves?"),
        ("sub/b.MP4", str(tmp_path / "sub/b.MP4"), None),
    ]
    table = tmp_path / "m.csv"
    table.write_text("id,path,prompt\nx,a.mp4,Say it.\ny,sub/b.MP4,\n")
    assert [(i.id, i.prompt) for i in vc.discover_inputs(table)] == [("x", "Say it."), ("y", None)]
    assert [i.id for i in vc.discover_inputs(str(tmp_path / "*.mp4"))] == [str(tmp_path / "a.mp4")]

    table.write_text("id,path\nx,a.mp4\nx,sub/b.MP4\n")
    with pytest.raises(vc.JobError, match="duplicate ids"):
        vc.discover_inputs(table)


def test_pictures_are_captioned_as_images_beside_videos(vc, caption_pair, tmp_path):
    """``--extensions videos,images``: a folder's pictures are captioned as images, with the image prompt, each
    caption the target's own greedy reply to the picture; its videos as before; a picture that cannot be read gets
    an error line and the job goes on. A manifest row bounding a picture in time is refused, naming the row."""
    folder = tmp_path / "media"
    _write_clips(folder, 1)
    for i in range(2):
        testbed.sample("image_caption", 600 + i).image.save(folder / f"pic{i}.png")
    (folder / "broken.jpg").write_bytes(b"not a picture")
    out = tmp_path / "captions.jsonl"
    args = [
        str(folder),
        "--out",
        str(out),
        "--extensions",
        "videos,images",
        *_pair_args(caption_pair),
        *COMMON,
    ]
    assert vc.main(args) == 2
    records = {r["id"]: r for r in _records(out)}
    assert sorted(records) == ["broken.jpg", "clip0.mp4", "pic0.png", "pic1.png"]
    assert "error" in records["broken.jpg"] and "caption" not in records["broken.jpg"]
    assert (
        records["clip0.mp4"]["prompt"] == "Describe this video in detail." and records["clip0.mp4"]["caption"]
    )
    pipe = VLMSpecPipeline.from_pretrained(*caption_pair, policy="ar")
    for name in ("pic0.png", "pic1.png"):
        assert records[name]["prompt"] == "Describe this image in detail."
        reply = pipe.reference_generate(pipe.prepare_inputs(str(folder / name), records[name]["prompt"]), 16)
        assert records[name]["caption"] == pipe.tokenizer.decode(reply, skip_special_tokens=True)
    assert vc.main(args) == 2  # a rerun tries the broken picture again (one line still) and keeps the rest
    assert sorted(r["id"] for r in _records(out)) == sorted(records)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"image": "media/pic0.png", "start": 1}\n')
    with pytest.raises(vc.JobError, match=r"line 1: 'media/pic0.png' is a picture"):
        vc.discover_inputs(manifest)


def test_a_folder_input_follows_symlinked_subfolders_once(vc, tmp_path):
    """A dataset linked into the input folder is captioned like a copied one; a link back up ends (no loop)."""
    data, job = tmp_path / "data", tmp_path / "job"
    (data / ".cache").mkdir(parents=True)
    job.mkdir()
    for name in ("clip.mp4", ".cache/partial.mp4"):
        (data / name).write_bytes(b"x")
    (job / "own.mp4").write_bytes(b"x")
    (job / "linked").symlink_to(data, target_is_directory=True)
    (data / "up").symlink_to(job, target_is_directory=True)
    assert [i.id for i in vc.discover_inputs(job)] == ["linked/clip.mp4", "own.mp4"]
    # A link to a folder that is also there for real: its videos keep their real ids, whichever name sorts first.
    (job / "real").mkdir()
    (job / "real" / "a.mp4").write_bytes(b"x")
    for alias in ("alias", "zz_alias", "a_dir/deeper"):  # a link in an earlier sibling's subtree too
        (job / alias).parent.mkdir(exist_ok=True)
        (job / alias).symlink_to(job / "real", target_is_directory=True)
        assert [i.id for i in vc.discover_inputs(job)] == ["linked/clip.mp4", "own.mp4", "real/a.mp4"]
        (job / alias).unlink()


def test_a_glob_through_a_folder_with_brackets_says_how_to_write_them(vc, tmp_path):
    (tmp_path / "clips [2023]").mkdir()
    (tmp_path / "clips [2023]" / "a.mp4").write_bytes(b"x")
    with pytest.raises(
        vc.JobError, match=r"holds no videos; '\[' starts a glob character class: write it as '\[\[\]'"
    ):
        vc.discover_inputs(f"{tmp_path}/clips [2023]/*.mp4")
    assert [i.path for i in vc.discover_inputs(f"{tmp_path}/clips [[]2023]/*.mp4")] == [
        f"{tmp_path}/clips [2023]/a.mp4"
    ]


def test_manifests_with_a_utf8_bom(vc, tmp_path):
    """Excel's "CSV UTF-8" starts the file with a byte order mark: it is not part of the first column's name."""
    (tmp_path / "a.mp4").write_bytes(b"x")
    table = tmp_path / "m.csv"
    table.write_bytes("\ufeffpath,prompt\na.mp4,Qué pasa?\n".encode())
    assert [(i.id, i.prompt) for i in vc.discover_inputs(table)] == [("a.mp4", "Qué pasa?")]
    lines = tmp_path / "m.jsonl"
    lines.write_bytes('\ufeff{"path": "a.mp4", "id": "first"}\n'.encode())
    assert [(i.id, i.path) for i in vc.discover_inputs(lines)] == [("first", str(tmp_path / "a.mp4"))]


def test_manifest_windows_caption_segments(vc, caption_pair, tmp_path, capsys):
    """Rows with ``start``/``end`` caption a segment of a file: a window over the whole file gives the whole
    file's caption, each half its own, a window past the end an error line (the job goes on)."""
    write_video(tmp_path / "long.mp4", _clip(500) + _clip(501), fps=4)  # 8 frames, 2 s
    rows = [
        {"path": "long.mp4"},
        {"path": "long.mp4", "start": 0, "end": 1.75},
        {"path": "long.mp4", "end": 0.75},
        {"path": "long.mp4", "start": 1.0, "id": "second half"},
        {"path": "long.mp4", "start": 5},
    ]
    manifest = tmp_path / "segments.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "captions.jsonl"
    args = [str(manifest), "--out", str(out), *_pair_args(caption_pair), *COMMON]
    assert vc.main(args) == vc.EXIT_PARTIAL
    records = {r["id"]: r for r in _records(out)}
    assert list(records) == ["long.mp4", "long.mp4@0-1.75", "long.mp4@0-0.75", "second half", "long.mp4@5-"]
    assert (records["long.mp4@0-1.75"]["start"], records["long.mp4@0-1.75"]["end"]) == (0, 1.75)
    assert "start" not in records["long.mp4"] and records["second half"]["start"] == 1.0
    assert records["long.mp4@0-1.75"]["caption"] == records["long.mp4"]["caption"]  # the same 4 frames
    assert records["long.mp4@0-0.75"]["caption"] != records["second half"]["caption"]
    assert "the clip from 5s to the end holds no frame" in records["long.mp4@5-"]["error"]
    assert "4 succeeded, 1 failed" in capsys.readouterr().out

    # --segment 1 over a folder: [0, 1] and [1, the end] of the 2 s video (last frame at 1.75 s); an unreadable
    # video stays whole and gets its error line.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "long.mp4").write_bytes((tmp_path / "long.mp4").read_bytes())
    (folder / "broken.mp4").write_bytes(os.urandom(2048))
    out = tmp_path / "dense.jsonl"
    args = [str(folder), "--out", str(out), "--segment", "1", *_pair_args(caption_pair), *COMMON]
    assert vc.main(args) == vc.EXIT_PARTIAL
    segments = {r["id"]: r for r in _records(out)}
    assert list(segments) == ["broken.mp4", "long.mp4@0-1", "long.mp4@1-"]
    assert (segments["long.mp4@0-1"]["start"], segments["long.mp4@0-1"]["end"]) == (0, 1)
    assert "end" not in segments["long.mp4@1-"] and "could not be decoded" in segments["broken.mp4"]["error"]
    assert segments["long.mp4@1-"]["caption"] == records["second half"]["caption"]  # the same window
    assert (
        vc.main(args) == vc.EXIT_PARTIAL and "2 already done" in capsys.readouterr().out
    )  # resumes by segment


def test_segments_cover_the_video_and_the_qwen_sampler_takes_windows(vc, caption_pair, tmp_path):
    """Windows of S seconds over a video whose last frame is at 1.75 s (the last window runs to the end, so none is
    a lone frame), and the qwen-vl-utils sampler on them."""
    write_video(tmp_path / "v.mp4", _clip(500) + _clip(501), fps=4)
    whole = [vc.VideoItem(id="v.mp4", path=str(tmp_path / "v.mp4"))]
    windows = {s: [(i.start, i.end) for i in vc.segment_items(whole, s)] for s in (0.5, 1, 1.75, 5)}
    assert windows == {
        0.5: [(0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, None)],
        1: [(0, 1), (1, None)],
        1.75: [(0, None)],
        5: [(0, None)],
    }
    out = tmp_path / "qwen.jsonl"
    qwen = ["--fps", "4", "--max-frames", "4", "--min-pixels", "3136", "--max-pixels", "12544"]
    args = [
        str(tmp_path / "*.mp4"),
        "--out",
        str(out),
        "--segment",
        "0.5",
        *_pair_args(caption_pair),
        *COMMON,
        *qwen,
    ]
    assert vc.main(args) == 0
    records = _records(out)
    assert [(r["start"], r.get("end")) for r in records] == windows[0.5] and all(
        r["caption"] for r in records
    )
    with pytest.raises(ValueError, match=r"from 1.8s to 1.9 has 0 frame\(s\)|holds no frame"):
        vc.qwen_frames(tmp_path / "v.mp4", {"start": 1.8, "end": 1.9})
    with pytest.raises(
        ValueError, match=r"from 1.75s to its end has 1 frame\(s\); qwen-vl-utils samples at least 2"
    ):
        vc.qwen_frames(tmp_path / "v.mp4", {"start": 1.75})


def test_segment_bounds_read_cleanly_and_sample_the_same_frames(vc, tmp_path):
    """``--segment 0.3``: bounds are 0.9, not binary floating point's 3 * 0.3 = 0.8999999999999999, and each window
    holds the frames the binary products would give, at any frame rate."""
    from vlmspec import VideoClip

    write_video(tmp_path / "v.mp4", _clip(500) + _clip(501), fps=4)  # last frame at 1.75 s
    items = vc.segment_items([vc.VideoItem(id="v.mp4", path=str(tmp_path / "v.mp4"))], 0.3)
    assert [(i.start, i.end) for i in items] == [
        (0.0, 0.3), (0.3, 0.6), (0.6, 0.9), (0.9, 1.2), (1.2, 1.5), (1.5, None),
    ]  # fmt: skip
    assert [i.id for i in items][3] == "v.mp4@0.9-1.2"
    assert b'"start": 0.9, "end": 1.2}' in vc.encode_record({"id": items[3].id, **items[3].window})
    for k, item in enumerate(items):
        binary = VideoClip(item.path, k * 0.3, None if item.end is None else (k + 1) * 0.3)
        for fps in (4.0, 10.0, 30.0, 1 / 0.3, 100.0):
            clip = VideoClip(item.path, item.start, item.end)
            assert clip.frame_window(1000, fps, "v") == binary.frame_window(1000, fps, "v")


def test_manifest_windows_are_checked_naming_the_row(vc, tmp_path):
    table = tmp_path / "m.csv"
    table.write_text("path,start,end\na.mp4,1,2.5\na.mp4,,1\n")
    items = vc.discover_inputs(table)
    assert [(i.id, i.start, i.end) for i in items] == [("a.mp4@1-2.5", 1.0, 2.5), ("a.mp4@0-1", None, 1.0)]
    table.write_text("path,start,end\na.mp4,3,2\n")
    with pytest.raises(vc.JobError, match=r"row 2: VideoClip end=2.0 must come after start=3.0"):
        vc.discover_inputs(table)
    table.write_text("path,start\na.mp4,soon\n")
    with pytest.raises(vc.JobError, match=r"row 2: 'start' must be a number of seconds, got 'soon'"):
        vc.discover_inputs(table)


def test_config_file_defaults_and_flag_overrides(vc, tmp_path):
    assert vc.load_config(vc.DEFAULT_CONFIG_PATH) == vc.JobConfig()  # the YAML holds the defaults
    config = tmp_path / "job.yaml"
    config.write_text("max_new_tokens: 7\npolicy: chain\npolicy_options: {gamma: 3}\nextensions: mp4, webm\n")
    parser = vc.build_parser()
    loaded = vc.load_config(
        str(config), vc.overrides_from_args(parser.parse_args(["in", "--max-new-tokens", "9"]))
    )
    assert (loaded.max_new_tokens, loaded.policy, loaded.policy_options) == (9, "chain", {"gamma": 3})
    assert loaded.extensions == (".mp4", ".webm")
    assert vc.load_config(str(config)).max_new_tokens == 7
    config.write_text("num_frames: 1\n")  # fine alone (decord); the flag makes it the qwen sampler's
    with pytest.raises(vc.JobError, match=r"job.yaml' with command-line flags: num_frames must be >= 2 with"):
        vc.load_config(str(config), {"max_pixels": 200000})
    config.write_text("max_new_tokens: many\n")
    with pytest.raises(vc.JobError, match="max_new_tokens=.* is invalid: expected an integer"):
        vc.load_config(str(config))
    assert vc.JobConfig(fps=1.0).sampler == "qwen" and vc.JobConfig().sampler == "decord"


def test_segment_ids_keep_every_digit_of_long_videos_bounds(vc, monkeypatch):
    monkeypatch.setattr(vc.inputs, "video_span", lambda path: (10010.0, 25.0))  # a 2 h 47 min video
    items = vc.segment_items([vc.VideoItem(id="long.mp4", path="long.mp4")], 1.25)
    assert len({i.id for i in items}) == len(items) == 8008
    assert [i.id for i in items][8001] == "long.mp4@10001.25-10002.5" and items[0].id == "long.mp4@0-1.25"


def test_a_segment_shorter_than_a_frame_fails_that_video_alone(vc, tmp_path):
    write_video(tmp_path / "v.mp4", _clip(500) + _clip(501), fps=4)
    write_video(tmp_path / "slow.mp4", _clip(500) + _clip(501), fps=1)
    items = vc.segment_items([vc.VideoItem(id=n, path=str(tmp_path / n)) for n in ("slow.mp4", "v.mp4")], 0.5)
    assert [i.id for i in items][:2] == ["slow.mp4", "v.mp4@0-0.5"] and items[1].problem is None
    assert re.search(
        r"segment=0.5 s is shorter than one frame of .*slow.mp4' \(1 s at 1 fps\)", items[0].problem
    )
    with pytest.raises(
        InvalidInputError, match="shorter than one frame"
    ):  # its caption attempt: an error line
        vc.run.caption_request(items[0], vc.JobConfig(), frames=lambda item: [])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_segment_must_be_a_finite_positive_number(vc, tmp_path, capsys, value):
    """From the flag and from a config file, through the same check (nan and inf pass a plain ``<= 0``)."""
    message = f"segment must be a finite number > 0, got {float(value)}"
    args = [str(tmp_path), "--out", str(tmp_path / "o.jsonl"), f"--segment={value}"]
    assert vc.main(args) == vc.EXIT_JOB_ERROR
    assert message in capsys.readouterr().err
    config = tmp_path / "job.yaml"
    yaml_value = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}.get(value, value)
    config.write_text(f"segment: {yaml_value}\n")
    with pytest.raises(vc.JobError, match=f"job.yaml': {message}"):
        vc.load_config(str(config))
    with pytest.raises(vc.JobError, match=message):
        vc.segment_items([vc.VideoItem("a", "a.mp4")], float(value))
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------------------
# The output file
# ---------------------------------------------------------------------------------------------------------------------
def test_torn_last_line_is_truncated_and_damage_elsewhere_stops(vc, tmp_path):
    out = tmp_path / "o.jsonl"
    good = vc.encode_record({"id": "a", "caption": "x"}) + vc.encode_record({"id": "b", "error": "e"})
    out.write_bytes(good + b'{"id": "c", "capt')  # no newline
    assert [r["id"] for r in vc.read_output(out, repair=False)] == ["a", "b"]
    assert out.read_bytes().endswith(b"capt")  # reading others' files never modifies them
    assert [r["id"] for r in vc.read_output(out, repair=True)] == ["a", "b"]
    assert out.read_bytes() == good
    out.write_bytes(good + b'{"id": "c", "capt\n')  # a whole but unparsable last line
    vc.read_output(out, repair=True)
    assert out.read_bytes() == good
    for tail in (b"{", b'{"i', b"\0\0\0", b'{"id": "c"\0\0'):  # a write cut within its first bytes, or zeros
        out.write_bytes(good + tail)
        assert [r["id"] for r in vc.read_output(out, repair=True)] == ["a", "b"] and out.read_bytes() == good
    for alone in (b"{", b"\0" * 4096):  # such bytes alone are not taken for the job's
        out.write_bytes(alone)
        with pytest.raises(vc.JobError, match="was not written by this job"):
            vc.read_output(out, repair=True)
        assert out.read_bytes() == alone
    out.write_bytes(b"garbage\n" + good)
    with pytest.raises(vc.JobError, match="line 1"):
        vc.read_output(out, repair=True)


def test_a_name_that_is_not_utf8_is_written_and_read_back(vc, tmp_path):
    name = os.fsdecode(b"caf\xe9.mp4")  # as a folder listing gives a Latin-1 file name: a lone surrogate
    out = tmp_path / "o.jsonl"
    out.write_bytes(vc.encode_record({"id": name, "caption": "c"}))
    assert [r["id"] for r in vc.read_output(out, repair=True)] == [name]


@pytest.mark.parametrize("text", [b"my own notes", b"my own notes\n", b"", b"\n\n"])
def test_a_file_the_job_did_not_write_is_never_changed(vc, tmp_path, text):
    out = tmp_path / "notes.txt"
    out.write_bytes(text)
    if text.strip():
        with pytest.raises(vc.JobError, match=r"notes.txt' was not written by this job \(line 1"):
            vc.read_output(out, repair=True)
        assert out.read_bytes() == text  # not a byte changed
    else:  # an empty file (or blank lines) holds nothing to lose: the job may use it
        assert vc.read_output(out, repair=True) == []


def test_the_output_must_be_a_regular_file(vc, tmp_path, capsys):
    os.mkfifo(fifo := tmp_path / "pipe")
    with pytest.raises(vc.JobError, match="is not a regular file"):  # before: the open waited for a reader
        vc.ResultWriter(fifo)
    assert vc.main([str(tmp_path), "--out", f"{tmp_path}/new/"]) == vc.EXIT_JOB_ERROR
    assert (
        "names a folder: give the output file" in capsys.readouterr().err and not (tmp_path / "new").exists()
    )
    for path in (tmp_path, Path("/dev/null")):
        with pytest.raises(vc.JobError, match="is not a regular file"):
            vc.read_output(path, repair=False)
    assert vc.encode_record({"caption": "x", "id": "a"}).startswith(vc.RECORD_START)  # the id always first


def test_writer_appends_whole_lines_and_locks(vc, tmp_path):
    out = tmp_path / "o.jsonl"
    with vc.ResultWriter(out) as writer:
        writer.write({"id": "a", "caption": "line\nbreak", "stats": {"tau": float("nan")}})
        with pytest.raises(vc.JobError, match="another running job"):
            vc.ResultWriter(out)
        writer.rewrite([{"id": "b", "caption": "y"}])
        writer.write({"id": "c", "caption": "z"})
    assert [r["id"] for r in _records(out)] == ["b", "c"]
    out.write_bytes(vc.encode_record({"id": "a", "caption": "line\nbreak", "stats": {"tau": float("nan")}}))
    assert _records(out) == [{"id": "a", "caption": "line\nbreak", "stats": {"tau": None}}]


def test_merge_prefers_captions_then_later_lines_in_input_order(vc, tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(
        vc.encode_record({"id": "b", "error": "old"}) + vc.encode_record({"id": "zz", "caption": "kept"})
    )
    vc.part_path(out, 0).write_bytes(vc.encode_record({"id": "a", "caption": "A"}))
    vc.part_path(out, 1).write_bytes(
        vc.encode_record({"id": "b", "caption": "B"}) + vc.encode_record({"id": "c", "error": "e1"})
    )
    vc.part_path(out, 2).write_bytes(
        vc.encode_record({"id": "c", "error": "e2"})
        + vc.encode_record({"id": "a", "error": "late"})
        + b'{"id": "d"'
    )  # a later error does not undo a caption; stale, torn
    items = [vc.VideoItem(i, i) for i in ("a", "b", "c", "d")]
    merged = vc.merge_outputs(out, items)
    assert [(r["id"], r.get("caption", r.get("error"))) for r in merged] == [
        ("a", "A"), ("b", "B"), ("c", "e2"), ("zz", "kept"),
    ]  # fmt: skip
    assert _records(out) == merged and not vc.part_files(out)
    lines = [{"id": "a", "caption": "x"}, {"id": "a", "error": "e"}, {"id": "b", "error": "e"}]
    assert store.statuses(lines) == {"a": "ok", "b": "error"}  # what a resumed run skips and retries


def test_resolve_pair(vc, monkeypatch, tmp_path):
    """The library's one resolver (vlmspec.named_pairs), with the job's family and its error type."""
    explicit = vc.resolve_pair("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct")
    assert (explicit.target, explicit.draft) == ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct")
    calls = []

    def pair_paths(size, family):
        calls.append((size, family))
        return tmp_path / "t", tmp_path / "d"

    monkeypatch.setattr(testbed, "pair_paths", pair_paths)
    pair = vc.resolve_pair("testbed-mini", None)
    assert (pair.target, pair.draft) == (str(tmp_path / "t"), str(tmp_path / "d"))
    assert vc.resolve_pair(None, None, family="llava_onevision").calibration == "cpu"  # the default pair
    assert calls == [("mini", "qwen2_vl"), ("base", "llava_onevision")]
    assert vc.resolve_pair("testbed-base", "some/draft").draft == "some/draft"  # as everywhere: it replaces
    with pytest.raises(vc.JobError, match="no 'qwen9' pair"):
        vc.resolve_pair("testbed-mini", None, family="qwen9")


def test_an_out_under_a_file_is_a_job_error_naming_it(tmp_path):
    from vlmspec_caption.store import ResultWriter

    (tmp_path / "out1.jsonl").write_text("")
    with pytest.raises(
        vlmspec_caption.JobError, match=r"its folder '.*out1.jsonl' cannot be made .*choose another --out"
    ):
        ResultWriter(tmp_path / "out1.jsonl" / "x.jsonl")


def test_merge_takes_only_the_job_s_part_files_and_repairs_a_torn_tail(vc, tmp_path):
    """Found by a mutation pass: a file merely named like a part file is neither merged nor deleted; merging a file
    with a torn tail and no part files leaves it whole; a damaged line before the last is refused, bytes unchanged."""
    out = tmp_path / "o.jsonl"
    out.write_bytes(vc.encode_record({"id": "a", "caption": "A"}) + b'{"id": "x')
    strangers = [out.with_name("o.jsonl.part-old.part2"), out.with_name("o.jsonl.part01")]
    for stranger in strangers:
        stranger.write_bytes(vc.encode_record({"id": "c", "caption": "C"}))
    merged = vc.merge_outputs(out, [vc.VideoItem("a", "a")])
    assert [r["id"] for r in merged] == ["a"] and all(s.exists() for s in strangers)
    assert out.read_bytes() == vc.encode_record({"id": "a", "caption": "A"})
    assert not store.scan_output(out).torn
    damaged = tmp_path / "d.jsonl"
    data = (
        vc.encode_record({"id": "a", "caption": "A"}) + b'{"id": "b", "cap\n' + vc.encode_record({"id": "c"})
    )
    damaged.write_bytes(data)
    with pytest.raises(vc.JobError):
        store.read_output(damaged, repair=True)
    assert damaged.read_bytes() == data


def test_structured_captions_follow_the_structure_and_are_recorded_in_the_settings(
    vc, caption_pair, six_videos, reference, tmp_path, capsys
):
    """--structured-outputs: every caption matches the expression (complete: the grammar ended it with EOS), at
    batch 3 as at batch 1, and the line's settings say which structure; a bad one is refused before any work."""
    regex = r"The video shows (one|two|three) shapes?( on a [a-z]+ background)?\."
    structure = json.dumps({"regex": regex})
    captions = {}
    for batch in ("1", "3"):
        out = tmp_path / f"structured{batch}.jsonl"
        argv = [str(six_videos), "--out", str(out), *_pair_args(caption_pair), *COMMON, "--batch-size", batch]
        assert vc.main([*argv, "--structured-outputs", structure]) == 0
        records = _records(out)
        assert all(r["settings"]["structured_outputs"] == {"regex": regex} for r in records)
        captions[batch] = {r["id"]: r["caption"] for r in records}
    assert captions["1"] == captions["3"] and len(captions["1"]) == 6
    assert all(re.fullmatch(regex, caption) for caption in captions["1"].values()), captions["1"]
    assert captions["1"] != reference
    bad = [str(six_videos), "--out", str(tmp_path / "bad.jsonl"), *_pair_args(caption_pair)]
    assert vc.main([*bad, "--structured-outputs", '{"regex": "a", "choice": ["a"]}']) == 1
    assert "--structured-outputs: structured_outputs sets regex and choice" in capsys.readouterr().err
    assert vc.main([*bad, "--structured-outputs", "[1]"]) == 1
    assert "--structured-outputs must be a JSON object" in capsys.readouterr().err
