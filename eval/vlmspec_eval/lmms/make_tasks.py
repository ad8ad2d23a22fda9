"""Generate the data of the local lmms-eval tasks in ``eval/tasks/`` (offline, deterministic).

    python -m vlmspec_eval.lmms.make_tasks --out eval/tasks/data --n 20

Writes, for ``n`` examples per task drawn from the testbed world (:func:`vlmspec.testbed.sample`, held-out seeds)
or, when the testbed is not importable (or ``--source synthetic``), from :mod:`vlmspec.testing`'s synthetic
pictures and clips with fixed prompts and references:

* ``image_qa.parquet``: ``doc_id, seed, question, answer, image`` (the image embedded, ``datasets.Image``);
* ``image_caption.parquet``: ``doc_id, seed, prompt, caption, image``;
* ``video_caption.parquet``: ``doc_id, seed, prompt, caption, video, frames``: ``video`` is the path of an mp4
  file under ``videos/`` relative to the data folder, ``frames`` the clip's frames embedded (``[datasets.Image]``)
  for the frames variant of the task;
* ``videos/*.mp4`` and ``manifest.json`` (source, seeds, counts).

The task YAMLs (``eval/tasks/vlmspec_*.yaml``) read ``data/<task>.parquet`` next to them; lmms-eval 0.7.3
resolves relative ``data_files`` of ``parquet``/``json`` datasets against the YAML's folder, and ``datasets``
loads local parquet files without the network (run with ``HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TASK_FILES", "main", "make_tasks", "write_parquet"]

TASK_FILES: dict[str, str] = {
    "image_qa": "image_qa.parquet",
    "image_caption": "image_caption.parquet",
    "video_caption": "video_caption.parquet",
}
"""Task of the testbed world -> parquet file in the data folder."""

_SYNTHETIC_ANSWERS: dict[str, str] = {
    "What color is the largest shape?": "red",
    "How many objects are there? Answer briefly.": "three",
    "Is there a circle in the image?": "yes",
    "Where is the red shape?": "center",
}
_SYNTHETIC_CAPTIONS: dict[str, str] = {
    "image_caption": "The image shows a few colored shapes on a gradient background.",
    "video_caption": "The video shows a yellow box moving from left to right over colored shapes.",
}


def make_tasks(out: str | Path, n: int = 20, seed: int = 0, source: str = "auto") -> dict[str, Any]:
    """Write the task data into ``out``.

    Args:
        out: data folder (created).
        n: examples per task (>= 1).
        seed: example ``i`` uses seed ``seed + i``.
        source: ``"auto"`` (testbed when importable), ``"testbed"`` or ``"synthetic"``.

    Returns:
        The manifest (also written to ``out/manifest.json``).

    Raises:
        ValueError: bad ``n``/``source`` or ``source="testbed"`` without the testbed.
    """
    from datasets import Image, List, Value

    from vlmspec_eval.tasks import load_inputs

    folder = Path(out)
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    inputs = load_inputs(list(TASK_FILES), n=n, seed=seed, source=source)
    by_task: dict[str, list[Any]] = {task: [i for i in inputs if i.task == task] for task in TASK_FILES}
    write_parquet(
        folder / TASK_FILES["image_qa"],
        _qa_rows(by_task["image_qa"], seed),
        _features("question", "answer", image=Image()),
    )
    write_parquet(
        folder / TASK_FILES["image_caption"],
        _caption_rows(by_task["image_caption"], seed),
        _features("prompt", "caption", image=Image()),
    )
    write_parquet(
        folder / TASK_FILES["video_caption"],
        _video_rows(by_task["video_caption"], seed, folder),
        _features("prompt", "caption", video=Value("string"), frames=List(Image())),
    )
    manifest = {
        "source": sorted({i.source for i in inputs}),
        "n": n,
        "seeds": [seed, seed + n - 1],
        "tasks": {task: TASK_FILES[task] for task in TASK_FILES},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _reference(item: Any) -> str:
    if item.reference is not None:
        return item.reference
    if item.task == "image_qa":
        return _SYNTHETIC_ANSWERS.get(item.prompt, "")
    return _SYNTHETIC_CAPTIONS[item.task]


def _qa_rows(items: Sequence[Any], seed: int) -> list[dict[str, Any]]:
    return [
        {"doc_id": i, "seed": seed + i, "question": it.prompt, "answer": _reference(it), "image": it.image}
        for i, it in enumerate(items)
    ]


def _caption_rows(items: Sequence[Any], seed: int) -> list[dict[str, Any]]:
    return [
        {"doc_id": i, "seed": seed + i, "prompt": it.prompt, "caption": _reference(it), "image": it.image}
        for i, it in enumerate(items)
    ]


def _video_rows(items: Sequence[Any], seed: int, folder: Path) -> list[dict[str, Any]]:
    from vlmspec.testing import write_video

    rows = []
    for i, it in enumerate(items):
        relative = f"videos/video_caption_{i:04d}.mp4"
        write_video(folder / relative, list(it.video))
        rows.append(
            {
                "doc_id": i,
                "seed": seed + i,
                "prompt": it.prompt,
                "caption": _reference(it),
                "video": relative,
                "frames": list(it.video),
            }  # fmt: skip
        )
    return rows


def _features(text: str, reference: str, **media: Any) -> Any:
    """A task file's columns: ``doc_id``, ``seed``, the prompt column ``text``, the ``reference`` column, then
    ``media`` (name -> ``datasets`` feature)."""
    from datasets import Features, Value

    columns = {
        "doc_id": Value("int32"),
        "seed": Value("int64"),
        text: Value("string"),
        reference: Value("string"),
    }
    return Features({**columns, **media})


def write_parquet(path: Path, rows: list[dict[str, Any]], features: Any) -> None:
    """``rows`` (dicts holding every column of ``features``) as a parquet file with those features."""
    from datasets import Dataset

    columns = {name: [row[name] for row in rows] for name in features}
    Dataset.from_dict(columns, features=features).to_parquet(str(path))


def data_command(module: str, doc: str, out: str, n: int, what: str) -> argparse.ArgumentParser:
    """The flags of a command that writes data for lmms-eval: ``--out`` (default ``out``), ``--n`` (``what``,
    default ``n``) and ``--seed`` (the first testbed seed)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m vlmspec_eval.lmms.{module}", description=doc.split("\n")[0]
    )
    parser.add_argument("--out", default=out, help=f"folder to write to (default {out})")
    parser.add_argument("--n", type=int, default=n, help=f"{what} (default {n})")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    return parser


def quiet_datasets() -> None:
    """No progress bars from ``datasets``: a data command's output is its one summary line."""
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = data_command("make_tasks", __doc__, out="eval/tasks/data", n=20, what="examples per task")
    parser.add_argument("--source", default="auto", choices=("auto", "testbed", "synthetic"))
    args = parser.parse_args(argv)
    quiet_datasets()
    manifest = make_tasks(args.out, n=args.n, seed=args.seed, source=args.source)
    print(f"wrote {args.n} examples per task ({', '.join(manifest['source'])}) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
