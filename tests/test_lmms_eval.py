"""lmms-eval integration: the ``vlmspec`` model through lmms-eval's CLI, offline, on local and shipped tasks.

The end-to-end tests run lmms-eval's command line as a subprocess (``HF_HUB_OFFLINE=1``; ``lmms_own_tasks.py``:
without indexing the shipped tasks) on the local tasks of ``eval/tasks`` (data generated into a temporary folder by ``make_tasks``) with the testbed's ``mini`` pair
(trained once and cached when missing, ~2 min on 2 CPU cores; ``VLMSPEC_LMMS_TEST_PAIR=tiny`` uses the tiny
random pair instead). They check that
SAGE's scores equal ``policy=ar``'s (lossless; the outputs' token hashes too), that the speed files are written,
that two processes (``accelerate launch``) give the same scores, and that bad ``--model_args`` fail with a message
naming them. The README's block for lmms-eval's own tasks (``mme``, ``videomme``, ``seedbench_ppl`` on stand-in
documents, :mod:`vlmspec_eval.lmms.standins`) runs as written in a scratch folder: SAGE's replies and
log-likelihoods equal AR's, and ``--force_simple`` scores as the default chat path. Skipped when lmms-eval is not
installed (``pip install -e .[eval]``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmms_eval")

from loguru import logger
from vlmspec_eval.lmms import generation, media, options, runtime, speed, text_metrics

from vlmspec.errors import InputNotFoundError, InvalidInputError
from vlmspec.inputs import VideoClip

REPO = Path(__file__).resolve().parents[1]
TASKS = ("vlmspec_image_qa", "vlmspec_image_caption", "vlmspec_video_caption", "vlmspec_video_caption_frames")
N_DOCS = 4
MAX_NEW_TOKENS = 16
CLI_TIMEOUT = 600


# ---------------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------------
def _pair_model_args(root: Path) -> str:
    """``target=...`` for the test pair: the testbed mini pair (built if needed), or the tiny one on request."""
    if os.environ.get("VLMSPEC_LMMS_TEST_PAIR") == "tiny":
        from vlmspec.testing import build_tiny_pair

        pair = build_tiny_pair("qwen2_vl", root=os.environ.get("VLMSPEC_TEST_CACHE") or root / "tiny")
        return f"target={pair.target},draft={pair.draft}"
    from vlmspec import testbed

    testbed.pair_paths(size="mini", family="qwen2_vl")  # trained once and cached: the subprocesses only load
    return "target=testbed-mini"


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder all pytest-xdist workers of this session share (pytest-xdist's documented pattern)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Task YAMLs copied next to freshly generated data, and the pair's model args (built once per session)."""
    from filelock import FileLock
    from vlmspec_eval.lmms.make_tasks import make_tasks

    root = _shared_dir(tmp_path_factory) / "lmms_eval"
    tasks = root / "tasks"
    with FileLock(f"{root}.lock"):
        if not (root / "pair.txt").is_file():
            tasks.mkdir(parents=True, exist_ok=True)
            for path in (REPO / "eval" / "tasks").iterdir():
                if path.is_file() and (
                    path.suffix in (".yaml", ".py") or path.name == "_default_template_yaml"
                ):
                    shutil.copy(path, tasks / path.name)
            make_tasks(tasks / "data", n=N_DOCS, seed=0)
            (root / "pair.txt").write_text(_pair_model_args(root))
    return {"root": root, "tasks": tasks, "pair": (root / "pair.txt").read_text()}


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), str(Path(__file__).parent)]),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(root / "hf_datasets"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_lmms_eval(
    ws: dict[str, Any], model_args: str, out: Path, processes: int = 1, tasks: tuple[str, ...] = TASKS
) -> tuple[int, str]:
    """Run lmms-eval's CLI on the plugin's own tasks (``lmms_own_tasks``: without indexing the shipped ones); returns
    its exit code and stdout+stderr (lmms-eval itself exits 0 when a run fails; the vlmspec model makes a bad
    --model_args fail: check the files too)."""
    cli = ["-m", "lmms_own_tasks", "--model", "vlmspec", "--model_args", model_args, "--tasks", ",".join(tasks),
           "--include_path", str(ws["tasks"]), "--output_path", str(out),
           "--gen_kwargs", f"max_new_tokens={MAX_NEW_TOKENS}"]  # fmt: skip
    if processes > 1:
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(_free_port())]  # fmt: skip
        cmd = [sys.executable, *launch, *cli]
        env = {**_env(ws["root"]), "ACCELERATE_USE_CPU": "1"}
    else:
        cmd, env = [sys.executable, *cli], _env(ws["root"])
    proc = subprocess.run(cmd, cwd=ws["root"], env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def _scores(out: Path, log: str) -> dict[str, dict[str, float]]:
    files = sorted(
        f for f in out.glob("**/*_results.json") if f.parent.name != "submissions"
    )  # tasks' own files
    assert files, f"lmms-eval wrote no results into {out}; its output ends with:\n{log[-4000:]}"
    results = json.loads(files[-1].read_text())["results"]
    return {
        task: {k: v for k, v in metrics.items() if "stderr" not in k and k != "alias"}
        for task, metrics in results.items()
    }


def _speed(out: Path, task: str) -> dict[str, Any]:
    return json.loads((out / speed.SPEED_FILE.format(task=task)).read_text())


@pytest.fixture(scope="session")
def cli_runs(workspace: dict[str, Any]) -> dict[str, Any]:
    """policy=ar, then sage on 2 processes with the AR run as speed reference (run once per session). Each process
    decodes its shard as a single process decodes all (the shards' results are then gathered), so the one sage run
    checks speculative decoding through the CLI and data parallelism (an lmms-eval start costs ~20 s)."""
    from filelock import FileLock

    ws, pair, root = workspace, workspace["pair"], workspace["root"]
    plan = (
        ("ar", f"{pair},policy=ar", 1),
        ("sage_2proc", f"{pair},policy=sage,ar_reference={root / 'ar'}", 2),
    )
    with FileLock(f"{root}/runs.lock"):
        for name, args, processes in plan:
            log_file = root / f"{name}.log"
            if not log_file.is_file():
                log_file.write_text(_run_lmms_eval(ws, args, root / name, processes=processes)[1])
    runs = {}
    for name, _, _ in plan:
        log = (root / f"{name}.log").read_text()
        runs[name] = {"out": root / name, "log": log, "scores": _scores(root / name, log)}
    return runs


# ---------------------------------------------------------------------------------------------------------------
# End to end (lmms-eval CLI, offline)
# ---------------------------------------------------------------------------------------------------------------
def test_cli_sage_is_lossless_and_writes_speed_files(cli_runs: dict[str, Any]) -> None:
    ar, sage = cli_runs["ar"], cli_runs["sage_2proc"]
    assert set(sage["scores"]) == set(TASKS)
    for task, metrics in ar["scores"].items():  # means over another document order: equal up to rounding
        assert sage["scores"][task] == pytest.approx(metrics, rel=1e-12, abs=1e-12), task
    for task in TASKS:
        report = _speed(sage["out"], task)
        metrics, reference = report["metrics"], report["reference"]
        assert report["run"]["policy"] == "sage" and metrics["n_samples"] == N_DOCS
        assert metrics["tau"] > 0 and metrics["tokens_per_second"] > 0 and metrics["lossless"]
        assert reference["n_matched"] == N_DOCS and reference["speedup"] > 0
        assert reference["identical_outputs"] == N_DOCS, f"{task}: outputs differ from the AR run's"
        assert _speed(ar["out"], task)["metrics"]["tau"] == 0
    assert "vlmspec summary" in sage["log"] and "vs AR" in sage["log"]
    results = json.loads(sorted(sage["out"].glob("**/*_results.json"))[-1].read_text())
    assert "avg_vlmspec_tau" in results["throughput"]


def test_cli_two_processes_give_the_same_outputs(cli_runs: dict[str, Any]) -> None:
    one, two = cli_runs["ar"], cli_runs["sage_2proc"]
    assert "Running on rank 1" in two["log"], "accelerate did not start a second process"
    assert "terminate called" not in two["log"], (
        "a rank aborted at exit (its process group left undestroyed?)"
    )
    for task in TASKS:
        report = _speed(two["out"], task)
        assert report["run"]["world_size"] == 2
        assert sorted(s["doc_id"] for s in report["samples"]) == list(range(N_DOCS))  # both shards gathered
        assert report["reference"]["identical_outputs"] == N_DOCS
        single = {s["doc_id"]: s["output_sha1"] for s in _speed(one["out"], task)["samples"]}
        assert {s["doc_id"]: s["output_sha1"] for s in report["samples"]} == single


def test_cli_bad_model_args_fail_naming_them(workspace: dict[str, Any]) -> None:
    """lmms-eval's command line shows the plugin's message; every bad value's own message is checked in process
    (``test_bad_model_args_name_the_key_or_value``), without an lmms-eval start (~20 s) each."""
    out = workspace["root"] / "bad_colour"
    code, log = _run_lmms_eval(workspace, f"{workspace['pair']},colour=red", out, tasks=("vlmspec_image_qa",))
    message = "unknown --model_args key(s) for the vlmspec model: 'colour'"
    assert message in log and code != 0, f"exit code {code}"
    assert not list(out.glob("**/*_results.json"))


# ---------------------------------------------------------------------------------------------------------------
# lmms-eval's own tasks on stand-in documents: the README's block, run as written
# ---------------------------------------------------------------------------------------------------------------
SHIPPED_TASKS = ("mme", "videomme", "seedbench_ppl", "ovo_forward")
# documents per task for the README's --n 2 (MME: two questions a picture)
STANDIN_DOCS = {"mme": 4, "videomme": 2, "seedbench_ppl": 2, "ovo_forward": 2}


def _readme_block(marker: str) -> str:
    """The README's ```bash block that contains ``marker``."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"README.md has {len(found)} bash blocks naming {marker}"
    return found[0]


@pytest.fixture(scope="session")
def readme_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The README's shipped-task block, run by bash as written in a scratch folder (``.venv`` linked to this
    interpreter's environment), once per session."""
    from filelock import FileLock

    root = _shared_dir(tmp_path_factory) / "lmms_readme"
    with FileLock(f"{root}.lock"):
        if not (root / "readme.log").is_file():
            root.mkdir(parents=True, exist_ok=True)
            if not (root / ".venv").is_symlink():
                (root / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
            script = _readme_block("vlmspec_eval.lmms.standins")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env,
                                  capture_output=True, text=True, timeout=CLI_TIMEOUT)  # fmt: skip
            (root / "readme.log").write_text(f"exit code {proc.returncode}\n{proc.stdout}{proc.stderr}")
    log = (root / "readme.log").read_text()
    standins = root / "standins"
    return {"root": root, "standins": standins, "log": log, "out": standins / "out"}


def _samples(out: Path, task: str) -> dict[int, Any]:
    """``doc_id -> filtered_resps`` of lmms-eval's ``--log_samples`` file for ``task``."""
    files = sorted(out.glob(f"*_samples_{task}.jsonl"))
    assert files, f"no samples file for {task} in {out}"
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    return {row["doc_id"]: row["filtered_resps"] for row in rows}


def _nll_pairs(resps: Any) -> list[tuple[float, bool]]:
    """A loglikelihood document's ``filtered_resps`` (one ``(nll, is_greedy)`` pair per choice, as logged)."""
    return [(float(value), str(greedy) == "True") for value, greedy in resps]


def test_readme_shipped_tasks_block_runs_as_written(readme_runs: dict[str, Any]) -> None:
    log, out = readme_runs["log"], readme_runs["out"]
    assert log.startswith("exit code 0\n"), log[-4000:]
    for policy in ("ar", "sage"):
        scores = _scores(out / policy, log)
        assert set(scores) == set(SHIPPED_TASKS), policy
        for task, n in STANDIN_DOCS.items():
            assert sorted(_samples(out / policy, task)) == list(range(n)), (policy, task)
    assert (readme_runs["standins"] / "hf" / "videomme" / "data" / "standin000.mp4").is_file()


def test_shipped_generation_tasks_reply_the_same_under_ar_and_sage(readme_runs: dict[str, Any]) -> None:
    out = readme_runs["out"]
    assert _scores(out / "sage", readme_runs["log"]) == _scores(out / "ar", readme_runs["log"])
    for task in ("mme", "videomme"):
        ar, sage = _samples(out / "ar", task), _samples(out / "sage", task)
        assert sage == ar, f"{task}: SAGE's replies differ from AR's"
        assert all(isinstance(reply, str) for reply in ar.values()) and any(ar.values()), task
        report = _speed(out / "sage", task)
        assert report["run"]["policy"] == "sage" and report["metrics"]["tau"] > 0, task
        assert report["reference"]["identical_outputs"] == STANDIN_DOCS[task], task


def test_shipped_loglikelihood_task_scores_the_same_under_ar_and_sage(readme_runs: dict[str, Any]) -> None:
    """``seedbench_ppl`` (``multiple_choice``: a loglikelihood request per choice) through the default chat path:
    equal values under both policies, and the direction lmms-eval ranks them in (its ``acc`` takes the lowest)."""
    from vlmspec_eval.lmms.standins import expected_seedbench_ppl_acc

    out = readme_runs["out"]
    ar, sage = _samples(out / "ar", "seedbench_ppl"), _samples(out / "sage", "seedbench_ppl")
    assert sage == ar, "SAGE's log-likelihoods differ from AR's"
    for doc_id, resps in ar.items():
        values = [value for value, _ in _nll_pairs(resps)]
        assert len(values) == 4 and all(math.isfinite(v) and v >= 0 for v in values), (doc_id, values)
        # each choice extends the previous one by a word: its -log p can only be larger
        assert values == sorted(values) and values[0] < values[-1], (doc_id, values)
    for policy in ("ar", "sage"):
        acc = _scores(out / policy, readme_runs["log"])["seedbench_ppl"]["acc,none"]
        assert acc == expected_seedbench_ppl_acc(STANDIN_DOCS["seedbench_ppl"]), policy


def _ovo_rounds(standins: Path) -> list[int]:
    """Rounds per ``ovo_forward`` stand-in document: one per ``test_info`` entry."""
    import pyarrow.parquet as pq
    from vlmspec_eval.lmms.standins import CONFIGS, DATASETS

    path = standins / DATASETS["ovo_forward"] / CONFIGS["ovo_forward"] / "test-00000-of-00001.parquet"
    return [len(info) for info in pq.read_table(path).column("test_info").to_pylist()]


def test_shipped_multi_round_task_answers_every_round_the_same_under_ar_and_sage(
    readme_runs: dict[str, Any],
) -> None:
    """``ovo_forward`` (``generate_until_multi_round``) through the default chat path: a reply per round of every
    document (2 or 3 rounds), the same under both policies, the task's own scoring run on them."""
    out, rounds = readme_runs["out"], _ovo_rounds(readme_runs["standins"])
    assert sorted(set(rounds)) == [2, 3]
    ar, sage = (_samples(out / policy, "ovo_forward") for policy in ("ar", "sage"))
    assert sage == ar, "SAGE's replies differ from AR's"
    assert [len(ar[doc_id]) for doc_id in sorted(ar)] == rounds
    assert all(isinstance(reply, str) and reply for replies in ar.values() for reply in replies)
    scored = json.loads((next((out / "sage").glob("**/forward_acc_results.json"))).read_text())
    assert [[step["response"] for step in doc["test_info"]] for doc in scored] == [ar[i] for i in sorted(ar)]
    report = _speed(out / "sage", "ovo_forward")  # a record per round, each checked against AR's
    assert report["reference"]["n_matched"] == report["reference"]["identical_outputs"] == sum(rounds)


def test_loglikelihood_force_simple_scores_as_the_chat_path(readme_runs: dict[str, Any]) -> None:
    """``--force_simple`` (the simple request path) gives the chat path's log-likelihoods, and the chat path's
    replies to every round of the multi-round task (whose prompt starts and ends with a newline: kept on both
    paths)."""
    standins = readme_runs["standins"]
    assert (readme_runs["out"] / "sage").is_dir(), readme_runs["log"][-4000:]
    out = standins / "out" / "simple"
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vlmspec", "--force_simple", "--model_args",
           "target=testbed-mini,policy=sage", "--tasks", "seedbench_ppl,ovo_forward", "--output_path", str(out),
           "--log_samples"]  # fmt: skip
    env = {**_env(readme_runs["root"]), "HF_HOME": str(standins / "hf")}
    proc = subprocess.run(cmd, cwd=standins, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and set(_scores(out, log)) == {"seedbench_ppl", "ovo_forward"}, log[-4000:]
    assert _samples(out, "seedbench_ppl") == _samples(readme_runs["out"] / "sage", "seedbench_ppl")
    replies = _samples(out, "ovo_forward")
    assert [len(replies[doc_id]) for doc_id in sorted(replies)] == _ovo_rounds(standins)
    assert replies == _samples(readme_runs["out"] / "sage", "ovo_forward")


# ---------------------------------------------------------------------------------------------------------------
# The model in process: simple path, frames, files, chat messages, loglikelihood
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(workspace: dict[str, Any]) -> Any:
    from vlmspec_eval.lmms.model import VLMSpec

    lm = VLMSpec.create_from_arg_string(
        f"{workspace['pair']},policy=sage,speed_dir={workspace['root'] / 'inproc'}", {"batch_size": 1}
    )
    from datasets import load_dataset

    data = workspace["tasks"] / "data"
    lm.task_dict = {
        name: load_dataset(
            "parquet",
            data_files={"test": str(data / f"{name}.parquet")},
            cache_dir=str(workspace["root"] / "hf"),
        )
        for name in ("image_qa", "video_caption")
    }
    return lm


def _instance(kind: str, args: tuple[Any, ...], task: str, doc_id: int = 0) -> Any:
    from lmms_eval.api.instance import Instance

    return Instance(kind, args, idx=0, metadata={"task": task, "doc_id": doc_id, "repeats": 1})


def test_simple_path_images_frames_and_files_give_the_same_replies(
    model: Any, workspace: dict[str, Any]
) -> None:
    data = workspace["tasks"] / "data"
    kwargs = {"max_new_tokens": 12}
    as_file = _video_file_instance(data, "<video>" + "Describe this video.", kwargs)
    as_frames = _instance(
        "generate_until",
        ("Describe this video.", kwargs, lambda d: [list(d["frames"])], 0, "video_caption", "test"),
        "video_caption",
    )
    image = _instance(
        "generate_until",
        (
            "<image>\nWhat is at the top?",
            {**kwargs, "until": ["\n"]},
            lambda d: [d["image"]],
            0,
            "image_qa",
            "test",
        ),
        "image_qa",
    )
    file_reply, frames_reply, image_reply = (
        r.text for r in model.generate_until([as_file, as_frames, image])
    )
    assert file_reply == frames_reply and file_reply
    assert "\n" not in image_reply


def _video_file_instance(data: Path, context: str, kwargs: dict[str, Any]) -> Any:
    """A ``generate_until`` request of the local video caption task, its video given as a file path."""
    visuals = lambda d: [str(data / d["video"])]  # noqa: E731
    return _instance(
        "generate_until", (context, kwargs, visuals, 0, "video_caption", "test"), "video_caption"
    )


def test_bad_generation_kwargs_fail_before_any_request_runs(model: Any, workspace: dict[str, Any]) -> None:
    data = workspace["tasks"] / "data"
    good = _video_file_instance(data, "Describe this video.", {"max_new_tokens": 4})
    bad = _instance(
        "generate_until",
        ("<image>\nWhat?", {"until": [5]}, lambda d: [d["image"]], 0, "image_qa", "test"),
        "image_qa",
    )
    done = len(model._samples)
    with pytest.raises(ValueError, match=r"task 'image_qa': generation kwarg until=\[5\] is invalid"):
        model.generate_until([good, bad])
    assert len(model._samples) == done  # the good request did not run first, only to be lost
    missing = _instance(
        "generate_until",
        ("Describe.", {"max_new_tokens": 4}, lambda d: [str(data / "gone.mp4")], 1, "video_caption", "test"),
        "video_caption",
    )
    with pytest.raises(InputNotFoundError, match=r"^task 'video_caption', document 1: video file .*gone.mp4"):
        model.generate_until([missing])  # from Python: the error itself, which a caller can catch


def cli_evaluate_stand_in(error: Exception) -> BaseException:
    """Named as lmms-eval's command line (and in a file whose path holds lmms_eval), to be seen as it."""
    return runtime.user_error(error)


def test_a_user_mistake_fails_lmms_eval_s_command_line_and_raises_in_python(tmp_path: Path) -> None:
    error = InvalidInputError("task 'x': generation kwarg temperature=-1.0 is invalid")
    assert runtime.user_error(error) is error and not runtime.running_lmms_eval_cli()
    as_cli = cli_evaluate_stand_in(error)
    assert isinstance(as_cli, SystemExit) and str(as_cli) == f"vlmspec model: {error}"
    (blocker := tmp_path / "file").write_text("")
    with pytest.raises(InvalidInputError, match=r"speed_dir='.*file/out' cannot be created .*give a folder"):
        speed.check_speed_dir(blocker / "out")
    speed.check_speed_dir(tmp_path / "new" / "out")
    assert (tmp_path / "new" / "out").is_dir()


def test_chat_path_takes_messages_with_a_system_turn(model: Any) -> None:
    from vlmspec_eval.lmms.model import VLMSpecChat

    chat = VLMSpecChat.__new__(VLMSpecChat)
    chat.__dict__.update(model.__dict__)
    messages = lambda d: [  # noqa: E731
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {
            "role": "user",
            "content": [
                {"type": "image", "url": d["image"]},
                {"type": "text", "text": "What is at the top?"},
            ],
        },
    ]
    request = _instance(
        "generate_until", ("", messages, {"max_new_tokens": 8}, 0, "image_qa", "test"), "image_qa"
    )
    (reply,) = chat.generate_until([request])
    assert isinstance(reply.text, str) and reply.token_counts.output_tokens > 0


def _canonical_text(tokenizer: Any, ids: list[int]) -> str:
    """The text of the longest prefix of ``ids`` that the tokenizer encodes back to exactly those ids."""
    for k in range(len(ids), 0, -1):
        text = tokenizer.decode(ids[:k])
        if tokenizer(text, add_special_tokens=False)["input_ids"] == ids[:k]:
            return text
    raise AssertionError("no prefix of the greedy reply round-trips through the tokenizer")


def test_loglikelihood_scores_the_greedy_reply_as_greedy(model: Any) -> None:
    doc = model.task_dict["image_qa"]["test"][0]
    pipe = model.pipe
    ids = pipe(doc["image"], doc["question"], max_new_tokens=6).token_ids
    specials = set(pipe.tokenizer.all_special_ids)
    reply = _canonical_text(pipe.tokenizer, [t for t in ids if t not in specials])
    visual = lambda d: [d["image"]]  # noqa: E731
    requests = [
        _instance("loglikelihood", (doc["question"], c, visual, 0, "image_qa", "test"), "image_qa")
        for c in (reply, reply + " zebra")
    ]
    greedy, other = (r.text for r in model.loglikelihood(requests))  # (nll, is_greedy) in the result's text
    assert greedy[1] is True and other[1] is False
    assert 0 <= greedy[0] < other[0]  # -log p: lmms-eval 0.7.3 ranks choices by the lowest value


# ---------------------------------------------------------------------------------------------------------------
# Registration, options, pair configs
# ---------------------------------------------------------------------------------------------------------------
def test_registered_through_the_entry_point_manifest() -> None:
    from lmms_eval import models
    from lmms_eval.api.registry import MODEL_REGISTRY
    from vlmspec_eval.lmms.manifest import MANIFEST

    assert models.get_model_manifest("vlmspec") == MANIFEST
    assert models.get_model("vlmspec").__name__ == "VLMSpecChat"
    assert models.get_model("vlmspec", force_simple=True).__name__ == "VLMSpec"
    assert "vlmspec" not in MODEL_REGISTRY  # @register_model's registry is not what the CLI reads


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"target": "tiny", "colour": "red"},
            "unknown --model_args key(s) for the vlmspec model: 'colour'; valid keys: target",
        ),
        (
            {"target ": "tiny"},
            "vlmspec model: 'target ' ('target ': remove the spaces around '=' and ',')",
        ),
        ({"target": "tiny", "prune_ratio": 1.5}, "prune_ratio=1.5 is invalid"),
        ({"target": "tiny", "video_prune_ratio": -0.1}, "video_prune_ratio=-0.1 is invalid"),
        (
            {"target": "tiny", "policy": "fastest"},
            "policy='fastest' is not a vlmspec policy; valid policies: ar",
        ),
        ({"target": "tiny", "dtype": "float8"}, "dtype='float8' is invalid: expected one of 'auto'"),
        ({"target": "tiny", "num_frames": "many"}, "num_frames='many' is invalid: expected an integer"),
        ({"target": "tiny", "warmup": "yes"}, "warmup='yes' is invalid: expected true or false"),
        ({"target": "tiny", "prefix_cache_gb": "-1"}, "prefix_cache_gb=-1.0 is invalid: use GiB >= 0"),
        ({"target": "tiny", "prune_ratio": "most"}, "prune_ratio='most' is invalid: expected a number"),
        ({"target": "tiny", "batch_size": 0}, "lmms-eval's --batch_size 0 is invalid: give an integer >= 1"),
        ({"target": "tiny", "policy": "chain", "gamma": "two"}, "ChainConfig.gamma='two' is invalid"),
        ({"target": "tiny", "max_new_tokens": 0}, "max_new_tokens=0 is invalid"),
        ({"target": "tiny", "pruning": "random"}, "pruning='random' is invalid"),
        ({"target": "tiny", "policy": "chain", "gamma": 0}, "ChainConfig.gamma=0 is invalid"),
        ({"target": "tiny", "policy": "static", "paths": "[[0]"}, "give a list option in a config= YAML"),
        (
            {"target": "tiny", "policy": "ar", "gamma": 2},
            "unknown --model_args key(s) for the vlmspec model: 'gamma'",
        ),
        ({"policy": "sage"}, "needs target=..."),
        (
            {"target": "Qwen/Qwen2-VL-7B-Instruct", "draft": "Qwen/Qwen3-VL-2B-Instruct"},
            "is a qwen2_vl model but draft=",
        ),
        (
            {"target": "tiny", "config": "no_such_pair"},
            "config='no_such_pair' is not a file nor a known pair config",
        ),
    ],
)
def test_bad_model_args_name_the_key_or_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=None) as err:
        options.parse_model_args(kwargs)
    assert message in str(err.value)


def test_model_args_text_is_converted_by_declared_type() -> None:
    """lmms-eval may pass text or already converted values: both give the same options."""
    text = {
        "target": "tiny", "draft": "none", "policy": "chain", "gamma": "3", "prune_ratio": "0.5", "dtype": "BF16",
        "pruning": "Uniform", "num_frames": "4", "max_new_tokens": 8.0, "seed": "-2", "warmup": "false",
        "trust_remote_code": "True", "device_map": 0, "batch_size": "2", "max_batch_size": None,
    }  # fmt: skip
    opts = options.parse_model_args(text)
    assert opts.policy_options == {"gamma": 3}
    assert (opts.draft, opts.image_prune_ratio, opts.video_prune_ratio) == (None, 0.5, 0.5)
    assert (opts.dtype, opts.pruning, opts.num_frames, opts.max_new_tokens) == ("bfloat16", "uniform", 4, 8)
    assert (opts.seed, opts.warmup, opts.trust_remote_code, opts.device_map, opts.batch_size) == (
        -2, False, True, "0", 2,
    )  # fmt: skip
    typed = {**text, "gamma": 3, "prune_ratio": 0.5, "num_frames": 4, "warmup": False, "batch_size": 2}
    assert options.parse_model_args(typed) == opts


def test_a_quantization_in_the_model_args_reaches_the_models() -> None:
    from optimum.quanto import QModuleMixin
    from vlmspec_eval.lmms.model import load_pipeline

    parsed = options.parse_model_args(
        {"target": "tiny", "policy": "chain", "draft_quantization": "quanto-int8"}
    )
    pipe = load_pipeline(parsed, options.resolve_pair(parsed), None)
    quantized = [
        sum(isinstance(m, QModuleMixin) for m in model.modules()) for model in (pipe.target, pipe.draft)
    ]
    assert quantized[0] == 0 and quantized[1] > 0


def test_model_options_are_one_validated_config() -> None:
    """Every --model_args key is a ModelOptions field (and back); a config built in Python is checked alike."""
    fields = {f.name for f in dataclasses.fields(options.ModelOptions)}
    assert fields - set(options.MODEL_ARGS) == {"policy_options", "batch_size", "device"}
    assert set(options.MODEL_ARGS) <= fields
    with pytest.raises(InvalidInputError, match="num_frames=0 is invalid: expected an integer >= 1"):
        options.ModelOptions(target="tiny", num_frames=0)
    with pytest.raises(InvalidInputError, match="ModelOptions.seed='1' is invalid: expected an integer"):
        options.ModelOptions(target="tiny", seed="1")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="bad option for policy 'chain'"):
        options.ModelOptions(target="tiny", policy="chain", policy_options={"gamma": 0})


def test_model_args_policy_options_and_overrides() -> None:
    opts = options.parse_model_args(
        {"config": "qwen2_5_vl-7b-3b", "policy": "chain", "gamma": 3, "prune_ratio": 0.5}
    )
    assert opts.target == "Qwen/Qwen2.5-VL-7B-Instruct" and opts.policy == "chain"
    assert opts.policy_options == {"gamma": 3}
    assert (opts.image_prune_ratio, opts.video_prune_ratio) == (0.5, 0.5)
    opts = options.parse_model_args(
        {"target": "tiny", "prune_ratio": 0.5, "video_prune_ratio": 0.95, "batch_size": "1"}
    )
    assert (opts.image_prune_ratio, opts.video_prune_ratio, opts.dtype) == (0.5, 0.95, "auto")


def test_a_pair_config_s_bad_value_names_the_file(tmp_path: Path) -> None:
    """A mistake in a pair config is reported with the file's path, not as a command-line one."""
    config = tmp_path / "my-pair.yaml"
    config.write_text("target: tiny\npolicy: chain\ngamma: 5\nvideo_prune_ratio: 2\n")
    with pytest.raises(InvalidInputError) as err:
        options.parse_model_args({"config": str(config)})
    assert str(err.value).startswith(f"pair config {str(config)!r}: video_prune_ratio=2.0 is invalid")
    config.write_text("target: tiny\ncolour: red\n")
    with pytest.raises(
        InvalidInputError, match=r"pair config .*my-pair.yaml.*unknown --model_args key.*colour"
    ):
        options.parse_model_args({"config": str(config), "policy": "chain"})
    config.write_text("target: tiny\n")
    with pytest.raises(InvalidInputError) as err:  # the command line's own mistake stays the command line's
        options.parse_model_args({"config": str(config), "prune_ratio": 3})
    assert str(err.value).startswith("prune_ratio=3.0 is invalid")


def test_a_policy_given_over_a_config_drops_the_config_s_own_policy_options(tmp_path: Path) -> None:
    config = tmp_path / "chain-pair.yaml"
    config.write_text("target: tiny\npolicy: chain\ngamma: 5\n")
    assert options.parse_model_args({"config": str(config)}).policy_options == {"gamma": 5}
    opts = options.parse_model_args({"config": str(config), "policy": "sage"})
    assert (opts.policy, opts.policy_options) == ("sage", {})
    opts = options.parse_model_args({"config": str(config), "policy": "chain", "gamma": 2})
    assert opts.policy_options == {"gamma": 2}


EXPECTED_PAIRS = {
    ("llava-hf/llava-onevision-qwen2-72b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf"),
    ("llava-hf/llava-onevision-qwen2-7b-ov-hf", "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"),
    ("Qwen/Qwen2-VL-72B-Instruct", "Qwen/Qwen2-VL-7B-Instruct"),
    ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct"),
    ("Qwen/Qwen2.5-VL-72B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct"),
    ("Qwen/Qwen3-VL-32B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"),
    ("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-2B-Instruct"),
    ("Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-2B"),
    ("OpenGVLab/InternVL3-78B-hf", "OpenGVLab/InternVL3-8B-hf"),
    ("OpenGVLab/InternVL3-8B-hf", "OpenGVLab/InternVL3-1B-hf"),
    ("OpenGVLab/InternVL3_5-30B-A3B-HF", "OpenGVLab/InternVL3_5-2B-HF"),
    ("google/gemma-3-27b-it", "google/gemma-3-4b-it"),
    ("google/gemma-3-12b-it", "google/gemma-3-4b-it"),
    ("llava-hf/llava-1.5-13b-hf", "llava-hf/llava-1.5-7b-hf"),
    ("llava-hf/llava-v1.6-vicuna-13b-hf", "llava-hf/llava-v1.6-vicuna-7b-hf"),
    ("HuggingFaceTB/SmolVLM2-500M-Video-Instruct", "HuggingFaceTB/SmolVLM2-256M-Video-Instruct"),
    ("HuggingFaceTB/SmolVLM-500M-Instruct", "HuggingFaceTB/SmolVLM-256M-Instruct"),
    ("mistralai/Ministral-3-14B-Instruct-2512", "mistralai/Ministral-3-3B-Instruct-2512"),
    ("zai-org/GLM-4.6V", "zai-org/GLM-4.6V-Flash"),
    ("CohereLabs/aya-vision-32b", "CohereLabs/aya-vision-8b"),
    ("thisisiron/Ovis2-8B-hf", "thisisiron/Ovis2-1B-hf"),
    ("deepseek-community/Janus-Pro-7B", "deepseek-community/Janus-Pro-1B"),
    ("deepseek-community/deepseek-vl-7b-chat", "deepseek-community/deepseek-vl-1.3b-chat"),
    ("lkhl/VideoLLaMA3-7B-HF", "lkhl/VideoLLaMA3-2B-HF"),
    ("google/gemma-4-31B-it", "google/gemma-4-E4B-it"),
    ("google/gemma-4-e2b-it", "google/gemma-4-e2b-it-assistant"),
    ("facebook/Perception-LM-8B", "facebook/Perception-LM-1B"),
    ("LiquidAI/LFM2-VL-3B", "LiquidAI/LFM2-VL-450M"),
    ("KamilaMila/FastVLM-7B", "KamilaMila/FastVLM-0.5B"),
    ("testbed-mini", None),
    ("testbed-base@cpu", None),
}


def test_a_saved_pipeline_gives_its_pair_with_the_model_args_settings(
    tiny_root: Path, tmp_path: Path
) -> None:
    """``target=<folder written by pipe.save_pretrained>``: its target/ and draft/, run with the model's own policy."""
    from vlmspec import VLMSpecPipeline
    from vlmspec.testing import build_tiny_pair

    pair = build_tiny_pair("qwen2_vl", root=tiny_root)
    saved = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", gamma=3).save_pretrained(
        tmp_path / "my-pipe"
    )
    opts = options.parse_model_args({"target": str(saved)})
    resolved = options.resolve_pair(opts)
    assert opts.policy == "sage" and opts.policy_options == {}  # not the saved chain settings
    assert (resolved.target, resolved.draft) == (str(saved / "target"), str(saved / "draft"))
    assert resolved.source == f"pipeline:{saved}"
    assert (
        options.resolve_pair(options.parse_model_args({"target": str(saved), "policy": "ar"})).draft is None
    )
    shutil.rmtree(saved / "draft")
    with pytest.raises(InvalidInputError, match="the saved pipeline .* holds no draft/: give draft="):
        options.resolve_pair(opts)


def test_a_mistyped_target_is_named_before_the_missing_draft(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidInputError, match=r"target 'testbd-mini' is not an existing folder.*testbed-mini"
    ):
        options.resolve_pair(options.parse_model_args({"target": "testbd-mini"}))
    missing = tmp_path / "my-pipee"
    with pytest.raises(FileNotFoundError, match=rf"target '{missing}' does not exist: give a model folder"):
        options.resolve_pair(options.parse_model_args({"target": str(missing)}))
    with pytest.raises(
        InvalidInputError, match=r"policy='sage' needs draft=\.\.\."
    ):  # a hub id: the draft is
        options.resolve_pair(options.parse_model_args({"target": "Qwen/Qwen2-VL-7B-Instruct"}))


def test_pair_configs_load_and_validate() -> None:
    paths = sorted((REPO / "configs" / "models").glob("*.yaml"))
    pairs = set()
    for path in paths:
        opts = options.parse_model_args({"config": str(path)})
        pairs.add((opts.target, opts.draft))
        assert opts.policy == "sage", path.name
        assert (opts.image_prune_ratio, opts.video_prune_ratio) == (0.8, 0.9), path.name
        assert opts.dtype in ("bfloat16", "float32"), path.name
        family = options.family_from_name(opts.target)
        assert family is not None and family == options.family_from_name(opts.draft or opts.target), path.name
        assert path.stem.startswith(family if opts.draft else "testbed"), path.name
    assert pairs == EXPECTED_PAIRS


FAMILY_BY_NAME = {  # checkpoint or pair name: the family vlmspec reads it as (None: none it takes)
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl",
    "Qwen/Qwen3.5-27B": "qwen3_5",
    "Qwen/Qwen3.5-35B-A3B": "qwen3_5",
    "tiny:qwen3_5": "qwen3_5",
    "LiquidAI/LFM2-VL-3B": "lfm2_vl",
    "LiquidAI/LFM2.5-VL-1.6B": "lfm2_vl",
    "tiny:lfm2_vl": "lfm2_vl",
    "LiquidAI/LFM3-VL-2B": "lfm3_vl",
    "tiny:lfm3_vl": "lfm3_vl",
    "LiquidAI/LFM2-1.2B": None,
    "openbmb/MiniCPM-V-4.6": "minicpmv4_6",
    "tiny:minicpmv4_6": "minicpmv4_6",
    "openbmb/MiniCPM-V-4.7-1B": "minicpmv4_7",
    "openbmb/MiniCPM-V-2_6": None,
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": "llava_onevision",
    "tiny:llava_onevision": "llava_onevision",
    "OpenGVLab/InternVL3_5-8B-HF": "internvl",
    "tiny:internvl": "internvl",
    "OpenGVLab/InternVL3_5-30B-A3B-HF": "internvl",
    "google/gemma-3-27b-it": "gemma3",
    "tiny:gemma3": "gemma3",
    "google/gemma-3n-E4B-it": None,
    "google/gemma-4-31B-it": "gemma4",
    "google/gemma-4-E2B-it": "gemma4",
    "tiny:gemma4": "gemma4",
    "llava-hf/llava-1.5-13b-hf": "llava",
    "liuhaotian/llava-v1.5-7b": "llava",
    "tiny:llava": "llava",
    "llava-hf/llava-v1.6-vicuna-13b-hf": "llava_next",
    "llava-hf/llama3-llava-next-8b-hf": "llava_next",
    "llava-hf/LLaVA-NeXT-Video-7B-hf": "llava_next_video",
    "HuggingFaceTB/SmolVLM2-256M-Video-Instruct": "smolvlm",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "idefics3",
    "HuggingFaceM4/Idefics3-8B-Llama3": "idefics3",
    "HuggingFaceM4/idefics2-8b": None,
    "mistralai/Ministral-3-14B-Instruct-2512": "mistral3",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "mistral3",
    "mistralai/Ministral-8B-Instruct-2410": None,
    "zai-org/GLM-4.6V-Flash": "glm46v",
    "zai-org/GLM-4.5V": "glm4v_moe",
    "zai-org/GLM-4.1V-9B-Thinking": "glm4v",
    "CohereLabs/aya-vision-8b": "aya_vision",
    "tiny:aya_vision": "aya_vision",
    "CohereLabs/aya-expanse-8b": None,
    "thisisiron/Ovis2-1B-hf": "ovis2",
    "tiny:ovis2": "ovis2",
    "ovis-community/Ovis2.5-2B": None,
    "KamilaMila/FastVLM-0.5B": "fast_vlm",
    "tiny:fast_vlm": "fast_vlm",
    "deepseek-community/Janus-Pro-1B": "janus",
    "tiny:janus": "janus",
    "deepseek-community/deepseek-vl-1.3b-chat": "deepseek_vl",
    "deepseek-community/deepseek-vl-7b-chat": "deepseek_vl",  # its hybrid tower, the same series
    "tiny:deepseek_vl": "deepseek_vl",
    "deepseek-ai/deepseek-vl2-tiny": None,
    "lkhl/VideoLLaMA3-2B-Image-HF": "video_llama_3",
    "tiny:video_llama_3": "video_llama_3",
    "DAMO-NLP-SG/VideoLLaMA2-7B": None,
    "facebook/Perception-LM-8B": "perception_lm",
    "tiny:perception_lm": "perception_lm",
    "/some/folder": None,
}


def test_family_from_name() -> None:
    assert {name: options.family_from_name(name) for name in FAMILY_BY_NAME} == FAMILY_BY_NAME


# ---------------------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------------------
def test_generation_settings() -> None:
    greedy = generation.generation_settings(
        {"until": "\n\n", "max_new_tokens": 64, "temperature": 0, "do_sample": True}
    )
    assert (greedy.do_sample, greedy.stop_strings, greedy.max_new_tokens) == (False, ("\n\n",), 64)
    sampled = generation.generation_settings({"temperature": 0.7, "top_p": 0.9}, cap=32)
    assert (sampled.do_sample, sampled.temperature, sampled.top_p, sampled.max_new_tokens) == (
        True,
        0.7,
        0.9,
        32,
    )
    assert not generation.generation_settings({"temperature": 0.7, "do_sample": False}).do_sample
    assert generation.generation_settings(None).max_new_tokens == generation.DEFAULT_MAX_NEW_TOKENS
    with pytest.raises(NotImplementedError, match="num_beams=4"):
        generation.generation_settings({"num_beams": 4})
    with pytest.raises(ValueError, match="until="):
        generation.generation_settings({"until": 3})
    assert generation.generation_settings({"repetition_penalty": 1.05}).repetition_penalty == 1.05
    assert generation.generation_settings({"min_new_tokens": 3}).min_new_tokens == 3
    with pytest.raises(ValueError, match="min_new_tokens=-1 is invalid"):
        generation.generation_settings({"min_new_tokens": -1})
    # A policy with no greedy form: refused for a greedy task with the kwargs to pass; its warm-up samples.
    from vlmspec import get_policy

    dsbd, greedy = get_policy("dsbd"), generation.generation_settings({})
    assert generation.sampling_only(dsbd) == {"do_sample": True, "top_k": 10, "top_p": 0.8}
    with pytest.raises(
        ValueError, match="run it with --gen_kwargs temperature=1,do_sample=true,top_k=10,top_p=0.8"
    ):
        generation.check_policy_decoding(dsbd, greedy)
    generation.check_policy_decoding(get_policy("sage"), greedy)
    with pytest.raises(ValueError, match="repetition_penalty=0 is invalid: expected a number > 0"):
        generation.generation_settings({"repetition_penalty": 0})
    assert generation.truncate_at_stops("a b\n\nc.", ("\n\n", ".")) == "a b"


def test_media_from_visuals_and_messages() -> None:
    from lmms_eval.protocol import ChatMessages
    from PIL import Image

    image, frames = Image.new("RGB", (8, 8)), [Image.new("RGB", (8, 8))] * 2

    def content(visuals: Any, context: str = "<image>\nQ?") -> list[dict[str, Any]]:
        (message,) = media.simple_messages(context, visuals)
        assert message["role"] == "user" and message["content"][-1] == {"type": "text", "text": "Q?"}
        return message["content"][:-1]

    # The simple path: images in order, then videos (any number), then the text, as pipe(image, prompt, video).
    assert content(["clip.mp4", image, image]) == [
        {"type": "image", "image": image}, {"type": "image", "image": image}, {"type": "video", "video": "clip.mp4"},
    ]  # fmt: skip
    assert (
        content([frames])
        == content({"type": "video", "frames": frames})
        == [{"type": "video", "video": frames}]
    )
    assert content(["a.mp4", "b.mp4"]) == [
        {"type": "video", "video": "a.mp4"},
        {"type": "video", "video": "b.mp4"},
    ]
    assert content(None) == []
    with pytest.raises(ValueError, match="extension"):
        media.simple_messages("Q?", ["sound.wav"])
    with pytest.raises(TypeError, match="unsupported visual"):
        media.simple_messages("Q?", [3])
    with pytest.raises(NotImplementedError, match="audio inputs are not supported"):
        media.simple_messages("Q?", [{"array": [0.0, 0.1], "sampling_rate": 16000}])
    assert media.strip_placeholders("<image>\nWhat is it? <video>") == "What is it?"
    assert media.strip_placeholders("\nWhat is it?\n") == "\nWhat is it?\n"  # as the chat path keeps it
    assert (
        media.strip_placeholders("<image>\nQ?\n") == "Q?\n"
        and media.strip_placeholders("A <image> B") == "A B"
    )
    messages = ChatMessages(messages=[{"role": "user", "content": [
        {"type": "image", "url": image}, {"type": "text", "text": "Compare"}, {"type": "video", "url": frames}]}])  # fmt: skip
    assert media.chat_messages(messages) == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "Compare"},
                {"type": "video", "video": frames},
            ],
        }
    ]
    # Clipped videos (egotempo's video_start/video_end dicts, chat parts' start_time/end_time) become VideoClips.
    clip = {"type": "video", "path": "clip.mp4", "video_start": 1.5, "video_end": 4}
    assert content([clip]) == [{"type": "video", "video": VideoClip("clip.mp4", 1.5, 4)}]
    assert content({"type": "video", "frames": frames, "end_time": 1}) == [
        {"type": "video", "video": VideoClip(frames, None, 1)}
    ]
    with pytest.raises(ValueError, match="clips .* an image"):
        content([{"type": "image", "url": image, "video_start": 1}])
    with pytest.raises(ValueError, match="end=1 must come after start=2"):
        content([{"type": "video", "path": "clip.mp4", "video_start": 2, "video_end": 1}])
    parts = [
        {"type": "video", "url": "clip.mp4", "start_time": 2.0, "end_time": 5.0},
        {"type": "text", "text": "?"},
    ]
    chat = media.chat_messages(ChatMessages(messages=[{"role": "user", "content": parts}]))
    assert chat[0]["content"][0] == {"type": "video", "video": VideoClip("clip.mp4", 2.0, 5.0)}


def test_text_metrics() -> None:
    assert text_metrics.exact_match("The Blue.", "blue") == 1.0
    assert text_metrics.exact_match("a large yellow circle", "a small yellow circle") == 0.0
    assert text_metrics.token_f1("large yellow circle", "small yellow circle") == pytest.approx(2 / 3)
    assert text_metrics.rouge_l("x b c d", "x c d e") == pytest.approx(0.75)
    assert text_metrics.rouge_l("", "") == 1.0 and text_metrics.rouge_l("x", "") == 0.0


def _sample(
    doc_id: int, seconds: float, policy: str = "sage", sha: str = "x", **kw: Any
) -> speed.SampleSpeed:
    values = dict(task="t", split="test", doc_id=doc_id, policy=policy, new_tokens=11, steps=5, accepted_tokens=5,
                  tokens_per_step=2.0, total_seconds=seconds, prefill_seconds=0.1, draft_prefill_seconds=0.0,
                  draft_seconds=0.1, verify_seconds=0.5, tree_nodes=50, target_visual_tokens=9,
                  draft_visual_tokens=2, lossless=True, output_sha1=sha)  # fmt: skip
    values.update(kw)
    return speed.SampleSpeed(**values)


def test_speed_reports_summaries_and_reference(tmp_path: Path) -> None:
    spec = [_sample(0, 1.0), _sample(1, 1.0, sha="y"), _sample(1, 9.0)]  # a padding duplicate of doc 1
    ar = [_sample(d, 3.0, policy="ar", steps=10, accepted_tokens=0, tokens_per_step=1.0) for d in (0, 1)]
    reports = speed.task_reports(spec, {"policy": "sage"}, {"t": ar})
    m, ref = reports["t"]["metrics"], reports["t"]["reference"]
    assert (
        m["n_samples"] == 2
        and m["tau"] == pytest.approx(1.0)
        and m["tokens_per_second"] == pytest.approx(11.0)
    )
    assert m["speedup_est"] == pytest.approx((0.1 + 10 * 0.1) / 1.0)
    assert ref["speedup"] == pytest.approx(3.0) and ref["identical_outputs"] == 1 and ref["n_matched"] == 2
    (path,) = speed.write_reports(reports, tmp_path)
    assert path.name == "vlmspec_speed_t.json"
    loaded = speed.load_reference(tmp_path, ["t"])
    assert [s.doc_id for s in loaded["t"]] == [0, 1]
    table = speed.format_summary(reports, {"t": "exact_match 0.5"})
    assert "3.00x vs AR (1/2 identical)" in table and "exact_match 0.5" in table
    # A reference decoded with other generation settings (max_new_tokens, ...) is flagged, not silently compared.
    short, longer = (generation.generation_settings({"max_new_tokens": n}) for n in (16, 48))
    ar_short = [dataclasses.replace(r, settings_sha1=speed._digest(repr(short))) for r in ar]
    spec_long = [dataclasses.replace(r, settings_sha1=speed._digest(repr(longer))) for r in spec[:2]]
    flagged = speed.task_reports(spec_long, {"policy": "sage"}, {"t": ar_short})
    assert flagged["t"]["reference"]["other_settings"] == 2
    assert "2 decoded with other settings: not comparable" in speed.format_summary(flagged)


def test_requests_that_ran_side_by_side_share_the_wall_time() -> None:
    # A alone for 1 s, then A and B together for 2 s, then B alone for 1 s; C alone later.
    shares = speed.shared_wall_seconds([(0.0, 3.0), (1.0, 4.0), (5.0, 6.0)])
    assert shares == pytest.approx([2.0, 2.0, 1.0])
    # Four requests over the same 1 s (batch 4): 0.25 s each, so tokens/s is the batch's, not one request's.
    shared = [
        _sample(d, 1.0, wall_seconds=w) for d, w in enumerate(speed.shared_wall_seconds([(0.0, 1.0)] * 4))
    ]
    metrics = speed.summarize(shared)
    assert metrics["wall_seconds"] == pytest.approx(1.0) and metrics["tokens_per_second"] == pytest.approx(
        44.0
    )
    assert metrics["total_seconds"] == pytest.approx(4.0)
    assert metrics["speedup_est"] == pytest.approx(speed.summarize(shared[:1])["speedup_est"])
    old_file = {k: v for k, v in dataclasses.asdict(shared[0]).items() if k != "wall_seconds"}
    assert (
        speed.SampleSpeed.from_dict(old_file).seconds == 1.0
    )  # files without the field: the request's own time


def test_output_path_from_the_command_line(tmp_path: Path) -> None:
    from vlmspec_eval.lmms.runtime import lmms_eval_output_path

    assert lmms_eval_output_path(["--model", "vlmspec", "--output_path", "out/x"]) == "out/x"
    assert lmms_eval_output_path(["--model", "vlmspec"]) is None
    assert (
        lmms_eval_output_path(["--model", "vlmspec", "--output", "out/y"]) == "out/y"
    )  # as lmms-eval reads it
    config = tmp_path / "run.yaml"
    config.write_text("- model: vlmspec\n  output_path: from_yaml\n")
    assert lmms_eval_output_path(["--config", str(config)]) == "from_yaml"


def test_batch_size_changes_no_reply(model: Any, workspace: dict[str, Any]) -> None:
    """``--batch_size 3``: the requests decode together (queued ones joining as rows free up), same replies, same
    order as one at a time; ``auto`` leaves the choice to the pipeline's cost probe."""
    data = workspace["tasks"] / "data"
    requests = [
        _instance("generate_until", (prompt, {"max_new_tokens": 10 + i}, visual, i % 2, task, "test"), task)
        for i, (prompt, visual, task) in enumerate(
            [
                ("<image>\nWhat is at the top?", lambda d: [d["image"]], "image_qa"),
                ("Describe this video.", lambda d: [str(data / d["video"])], "video_caption"),
                ("<image>\nHow many shapes are there?", lambda d: [d["image"]], "image_qa"),
                ("Describe this video briefly.", lambda d: [list(d["frames"])], "video_caption"),
                ("<image>\nName the colours.", lambda d: [d["image"]], "image_qa"),
            ]
        )
    ]
    alone = [r.text for r in model.generate_until(requests)]
    one_at_a_time = model.options
    model.options = dataclasses.replace(one_at_a_time, batch_size=3)
    try:
        assert model.batch_size == 3
        first, start = len(model._samples), time.perf_counter()
        together = [r.text for r in model.generate_until(requests)]
        wall = time.perf_counter() - start
    finally:
        model.options = one_at_a_time
    assert together == alone and all(alone)
    # The requests overlapped: their own times add up to more than the run took, their shares of it do not.
    records = model._samples[first:]
    assert sum(r.wall_seconds for r in records) <= wall < sum(r.total_seconds for r in records)
    assert options.parse_model_args({"target": "tiny", "batch_size": "auto"}).batch_size is None


def test_a_prefix_cache_reuses_a_picture_asked_about_twice_with_the_same_replies(
    model: Any, workspace: dict[str, Any]
) -> None:
    """``prefix_cache_gb``: two questions about one picture; the second prefills only its question."""
    from vlmspec_eval.lmms.model import VLMSpec

    requests = [
        _instance(
            "generate_until",
            (prompt, {"max_new_tokens": 10}, lambda d: [d["image"]], 0, "image_qa", "test"),
            "image_qa",
        )
        for prompt in ("<image>\nWhat is at the top?", "<image>\nWhat is at the bottom?")
    ]
    cached = VLMSpec.create_from_arg_string(
        f"{workspace['pair']},policy=sage,prefix_cache_gb=0.5,warmup=false", {"batch_size": 1}
    )
    cached.task_dict = model.task_dict
    assert cached.pipe.prefix_cache.max_bytes == 2**29
    assert [r.text for r in cached.generate_until(requests)] == [
        r.text for r in model.generate_until(requests)
    ]
    first, second = (r.cached_prompt_tokens for r in cached._samples[-2:])
    assert first == 0 and second > 0  # the picture and the text before the question came from the cache
    assert model.pipe.prefix_cache is None


def _round_task(rounds: dict[int, int], calls: list[tuple[int, int, list[str], Any]]):
    """A multi-round task's ``doc_to_text`` (lmms-eval's protocol): ``rounds[doc_id]`` rounds about the picture,
    each call recorded as ``(doc_id, round_idx, previous_output, previous_round_info)``."""

    def doc_to_text(doc: dict[str, Any], previous_output=None, round_idx=None, previous_round_info=None):
        calls.append((doc["doc_id"], round_idx, list(previous_output), previous_round_info))
        if round_idx == rounds[doc["doc_id"]]:
            return None, None, True, previous_output, None
        return (
            [doc["image"]],
            f"<image>\nQuestion {round_idx}: what is at the top?",
            False,
            previous_output,
            -round_idx,
        )

    return doc_to_text


def test_multi_round_asks_the_task_for_each_round_with_the_replies_so_far(model: Any) -> None:
    """``generate_until_multi_round`` on both request paths, two requests decoding together that leave after 3
    and 2 rounds: round ``k``'s reply is the pipeline's own reply to the prompt the task built for round ``k``
    (a fresh single-turn prompt), and the task saw the replies so far and its own round info."""
    from vlmspec_eval.lmms.model import VLMSpecChat

    calls: list[tuple[int, int, list[str], Any]] = []
    doc_to_text = _round_task({0: 3, 1: 2}, calls)
    kwargs = {"max_new_tokens": 8}
    visual = lambda d: [d["image"]]  # noqa: E731
    simple = [
        _instance(
            "generate_until_multi_round",
            ("<image>\nQuestion 0: what is at the top?", kwargs, visual, doc_to_text, i, "image_qa", "test"),
            "image_qa",
            doc_id=i,
        )  # fmt: skip
        for i in (0, 1)
    ]

    def messages(doc: dict[str, Any], round_idx=None, previous_output=None, previous_round_info=None):
        if round_idx is None:
            turn = [
                {"type": "image", "url": doc["image"]},
                {"type": "text", "text": "Question 0: what is at the top?"},
            ]
            return [{"role": "user", "content": turn}]
        visuals, text, terminal, prev, info = doc_to_text(
            doc, previous_output, round_idx, previous_round_info
        )
        if terminal:
            return None, True, prev, info
        turn = [
            {"type": "image", "url": visuals[0]},
            {"type": "text", "text": text.removeprefix("<image>\n")},
        ]
        return [{"role": "user", "content": turn}], False, prev, info

    chat_requests = [
        _instance(
            "generate_until_multi_round", ("", messages, kwargs, i, "image_qa", "test"), "image_qa", doc_id=i
        )
        for i in (0, 1)
    ]
    chat = VLMSpecChat.__new__(VLMSpecChat)
    chat.__dict__.update(model.__dict__)
    one_at_a_time = model.options
    model.options = chat.options = dataclasses.replace(one_at_a_time, batch_size=2)
    try:
        replies = model.generate_until_multi_round(simple)
        simple_calls, calls[:] = list(calls), []
        chat_replies = chat.generate_until_multi_round(chat_requests)
    finally:
        model.options = one_at_a_time
    docs = model.task_dict["image_qa"]["test"]
    for doc_id, n in ((0, 3), (1, 2)):
        own = [
            model.pipe(
                docs[doc_id]["image"], f"Question {k}: what is at the top?", max_new_tokens=8
            ).text.strip()
            for k in range(n)
        ]
        assert replies[doc_id] == chat_replies[doc_id] == own and all(own), doc_id
        asked = [(k, prev, info) for d, k, prev, info in simple_calls if d == doc_id]
        assert asked == [(k, own[:k], None if k == 1 else 1 - k) for k in range(1, n + 1)], doc_id
    assert sorted(calls) == sorted(simple_calls)


def test_multi_round_task_breaking_the_protocol_fails_naming_it(model: Any) -> None:
    """A multi-round ``doc_to_text`` that returns a bare string for a later round: an error naming the task, the
    round and the tuple lmms-eval's protocol expects."""
    doc_to_text = lambda doc, **round_kwargs: "What is at the top?"  # noqa: E731
    request = _instance(
        "generate_until_multi_round",
        ("<image>\nWhat is at the top?", {"max_new_tokens": 4}, lambda d: [d["image"]], doc_to_text, 0, "image_qa",
         "test"),
        "image_qa",
    )  # fmt: skip
    with pytest.raises(InvalidInputError, match=r"task 'image_qa': its doc_to_text returned str for round 1; .*"
                       r"\(visuals, context, terminal, previous_output, previous_round_info\)"):  # fmt: skip
        model.generate_until_multi_round([request])


def test_an_ar_reference_that_cannot_serve_is_refused_before_generation(tmp_path):
    def speed_file(folder: Path, task: str, policy: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / speed.SPEED_FILE.format(task=task)
        path.write_text(json.dumps({"task": task, "run": {"policy": policy}, "samples": []}))
        return path

    ar = tmp_path / "ar"
    speed_file(ar, "qa", "ar")
    speed.check_reference(ar)  # an AR run: serves
    with pytest.raises(FileNotFoundError, match="does not exist"):
        speed.check_reference(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no vlmspec_speed_<task>.json"):
        speed.check_reference(tmp_path / "empty")
    with pytest.raises(ValueError, match="is a policy='sage' run; the speed-up needs a policy=ar run"):
        speed.check_reference(speed_file(tmp_path / "sage", "qa", "sage"))
    (bad := tmp_path / "bad.json").write_text("{bad")
    with pytest.raises(ValueError, match="bad.json is not a speed file"):
        speed.check_reference(bad)
    logged: list[str] = []
    sink = logger.add(logged.append, level="WARNING", format="{message}")
    try:
        assert list(speed.load_reference(ar, ["qa", "caption"])) == ["qa"]  # the run's results are kept
    finally:
        logger.remove(sink)
    assert any("holds no AR run of ['caption']: no speed-up for them" in line for line in logged)


def test_tokens_per_step_is_pooled_over_steps() -> None:
    """Two requests of 1 and 3 steps at 1.0 and 3.0 tokens/step: 10 tokens over 4 steps, 2.5 (not the mean 2.0)."""
    samples = [_sample(0, 1.0, steps=1, tokens_per_step=1.0), _sample(1, 1.0, steps=3, tokens_per_step=3.0)]
    assert speed.summarize(samples)["tokens_per_step"] == pytest.approx(2.5)
