"""Local stand-in data for shipped lmms-eval tasks: ``--tasks mme,videomme,seedbench_ppl`` offline, unchanged.

    python -m vlmspec_eval.lmms.standins --out standins --n 4
    cd standins && export HF_HOME=$PWD/hf HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    lmms-eval --model vlmspec --model_args target=testbed-mini --tasks mme,videomme,seedbench_ppl --output_path out

How it works (lmms-eval 0.7.3, datasets 5.x): a task loads its data with ``datasets.load_dataset(dataset_path)``,
and ``datasets`` loads a *local folder* of that name (relative to the working directory) before it asks the Hub.
So ``lmms-lab-encoder/MME/data/test-00000-of-00001.parquet``, with the Hub dataset's columns, serves the shipped
``mme`` task as it is: its prompts, answer parsing, scoring and aggregation run unchanged, only the documents
are stand-ins. Video-MME's task reads its videos from ``$HF_HOME/videomme/data/<videoID>.mp4`` (its ``utils``)
and skips its download when ``$HF_HOME/videomme`` exists.

What is written into ``out`` (``n`` documents per dataset, ``2n`` for MME, drawn from the testbed world,
:mod:`vlmspec.testbed`, held-out seeds):

* ``lmms-lab-encoder/MME``: ``question_id, image, question, answer, category``: ``n`` pictures with two
  questions each, one answered yes and one no (MME scores a picture's pair together), perception and cognition
  categories, for ``mme``;
* ``lmms-eval/Video-MME`` and ``hf/videomme/data/*.mp4``: ``video_id, duration, domain, sub_category, url,
  videoID, question_id, task_type, question, options, answer`` (which sentence describes the clip), for
  ``videomme``;
* ``lmms-lab-encoder/SEED-Bench``: ``answer, choice_a..choice_d, data_id, data_type, question, question_id,
  question_type_id, image`` (a list of pictures), for ``seedbench_ppl`` (a ``multiple_choice`` task: one
  ``loglikelihood`` request per choice). The choices nest: each is the previous one plus an
  unlikely word, so (with a tokenizer that splits at spaces) A's continuation is a prefix of B's, B's of C's,
  ...: A is the most likely choice under any model. The answer is A except for every fourth document (D), so a
  run's ``acc`` must be the share of documents answered A (:func:`expected_seedbench_ppl_acc`), a check that
  the model's scores point the way lmms-eval ranks them (lowest wins).
* ``manifest.json``: what was written and ``HF_HOME`` to use.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DATASETS", "HF_HOME", "expected_seedbench_ppl_acc", "main", "make_standins"]

DATASETS: dict[str, str] = {
    "mme": "lmms-lab-encoder/MME",
    "videomme": "lmms-eval/Video-MME",
    "seedbench_ppl": "lmms-lab-encoder/SEED-Bench",
}
"""Shipped task -> the ``dataset_path`` of its YAML (lmms-eval 0.7.3), i.e. the folder its stand-in goes in."""

HF_HOME = "hf"
"""``HF_HOME`` for the run, relative to ``out`` (Video-MME's videos are under ``$HF_HOME/videomme/data``)."""

PARQUET = "data/test-00000-of-00001.parquet"
_MME_CATEGORIES = ("existence", "color", "count", "commonsense_reasoning")
_SEED_EXTRA_WORDS = ("zebra", "violin", "teapot")
_LETTERS = "ABCD"


def make_standins(out: str | Path, n: int = 4, seed: int = 0) -> dict[str, Any]:
    """Write the stand-in datasets (and Video-MME's videos) into ``out``.

    Args:
        out: folder to run lmms-eval in (created).
        n: documents per dataset (>= 1).
        seed: document ``i`` is drawn with testbed seed ``seed + i``.

    Returns:
        The manifest (also written to ``out/manifest.json``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} is invalid: expected an integer >= 1")
    folder = Path(out)
    videos = folder / HF_HOME / "videomme" / "data"
    videos.mkdir(parents=True, exist_ok=True)
    _write(folder / DATASETS["mme"], _mme_rows(n, seed), _mme_features())
    _write(folder / DATASETS["videomme"], _videomme_rows(n, seed, videos), _videomme_features())
    _write(folder / DATASETS["seedbench_ppl"], _seed_rows(n, seed), _seed_features())
    manifest = {
        "n": n,
        "seeds": [seed, seed + n - 1],
        "datasets": {task: f"{path}/{PARQUET}" for task, path in DATASETS.items()},
        "hf_home": HF_HOME,
        "seedbench_ppl_acc": expected_seedbench_ppl_acc(n),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def expected_seedbench_ppl_acc(n: int) -> float:
    """``seedbench_ppl``'s ``acc`` on ``n`` stand-in documents for any model (the share answered A)."""
    return sum(_seed_answer(i) == "A" for i in range(n)) / n


# ---- MME -------------------------------------------------------------------------------------------------------
def _mme_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Two questions per picture, one answered yes and one no (MME scores a picture's pair together)."""
    from vlmspec.testbed import sample

    rows = []
    for i in range(n):
        example = sample("image_qa", seed + i)
        shape = example.scene.shapes[0]
        for colour, answer in ((shape.colour, "Yes"), (_absent_colour(example.scene), "No")):
            rows.append(
                {
                    "question_id": f"standin/{i:04d}.png",
                    "image": example.image,
                    "question": f"Is there a {colour} {shape.kind} in the image? Please answer yes or no.",
                    "answer": answer,
                    "category": _MME_CATEGORIES[i % len(_MME_CATEGORIES)],
                }
            )
    return rows


def _absent_colour(scene: Any) -> str:
    from vlmspec.testbed.world import COLOURS

    present = {s.colour for s in scene.shapes}
    return next(c for c in COLOURS if c not in present)


def _mme_features() -> Any:
    from datasets import Features, Image, Value

    return Features(
        {
            "question_id": Value("string"),
            "image": Image(),
            "question": Value("string"),
            "answer": Value("string"),
            "category": Value("string"),
        }
    )


# ---- Video-MME -------------------------------------------------------------------------------------------------
def _videomme_rows(n: int, seed: int, videos: Path) -> list[dict[str, Any]]:
    from vlmspec.testbed import sample, write_video

    clips = [sample("video_caption", seed + i) for i in range(n)]
    captions = [c.reference.split(". ")[1] + "." for c in clips]  # "The first shape is ..."
    rows = []
    for i, clip in enumerate(clips):
        video_id = f"standin{i:03d}"
        write_video(videos / f"{video_id}.mp4", list(clip.video))
        answer = _LETTERS[i % 4]
        others = [c for c in captions if c != captions[i]] + [f"Nothing happens {k}." for k in range(3)]
        texts = others[:3]
        texts.insert(_LETTERS.index(answer), captions[i])
        rows.append(
            {
                "video_id": f"{i:03d}",
                "duration": "short",
                "domain": "Knowledge",
                "sub_category": "Humanity & History",
                "url": "",
                "videoID": video_id,
                "question_id": f"{i:03d}-1",
                "task_type": "Attribute Perception",
                "question": "Which sentence describes the first shape of the video?",
                "options": [f"{letter}. {text}" for letter, text in zip(_LETTERS, texts, strict=True)],
                "answer": answer,
            }
        )
    return rows


def _videomme_features() -> Any:
    from datasets import Features, List, Value

    text = ("video_id", "duration", "domain", "sub_category", "url", "videoID", "question_id", "task_type",
            "question")  # fmt: skip
    return Features(
        {
            **{name: Value("string") for name in text},
            "options": List(Value("string")),
            "answer": Value("string"),
        }
    )


# ---- SEED-Bench ------------------------------------------------------------------------------------------------
def _seed_answer(i: int) -> str:
    return "D" if i % 4 == 3 else "A"


def _seed_rows(n: int, seed: int) -> list[dict[str, Any]]:
    from vlmspec.testbed import sample

    rows = []
    for i in range(n):
        example = sample("image_qa", seed + i)
        choices = [example.reference]
        for word in _SEED_EXTRA_WORDS:
            choices.append(f"{choices[-1]} {word}")
        rows.append(
            {
                "answer": _seed_answer(i),
                **{f"choice_{letter.lower()}": c for letter, c in zip(_LETTERS, choices, strict=True)},
                "data_id": f"standin_{i:04d}",
                "data_type": "image",
                "question": example.prompt,
                "question_id": str(i),
                "question_type_id": 1,
                "image": [example.image],
            }
        )
    return rows


def _seed_features() -> Any:
    from datasets import Features, Image, List, Value

    return Features(
        {
            "answer": Value("string"),
            **{f"choice_{letter.lower()}": Value("string") for letter in _LETTERS},
            "data_id": Value("string"),
            "data_type": Value("string"),
            "question": Value("string"),
            "question_id": Value("string"),
            "question_type_id": Value("int64"),
            "image": List(Image()),
        }
    )


def _write(dataset_folder: Path, rows: list[dict[str, Any]], features: Any) -> None:
    from datasets import Dataset

    path = dataset_folder / PARQUET
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {name: [row[name] for row in rows] for name in features}
    Dataset.from_dict(columns, features=features).to_parquet(str(path))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m vlmspec_eval.lmms.standins", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="standins", help="folder to run lmms-eval in (default standins)")
    parser.add_argument("--n", type=int, default=4, help="documents per dataset (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="first testbed seed (default 0)")
    args = parser.parse_args(argv)
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    make_standins(args.out, n=args.n, seed=args.seed)
    tasks = ",".join(DATASETS)
    print(f"wrote {args.n} stand-in documents for {tasks} to {args.out}; run lmms-eval there with "
          f"HF_HOME={Path(args.out).resolve() / HF_HOME} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
