"""Local stand-in data for shipped lmms-eval tasks: ``--tasks mme,videomme,seedbench_ppl,ovo_forward`` offline.

    python -m vlmspec_eval.lmms.standins --out standins --n 4
    cd standins && export HF_HOME=$PWD/hf HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    lmms-eval --model vlmspec --model_args target=testbed-mini --tasks mme,videomme,seedbench_ppl,ovo_forward \
        --output_path out

How it works (lmms-eval 0.7.3, datasets 5.x): a task loads its data with ``datasets.load_dataset(dataset_path)``,
and ``datasets`` loads a *local folder* of that name (relative to the working directory) before it asks the Hub.
So ``lmms-lab-encoder/MME/data/test-00000-of-00001.parquet``, with the Hub dataset's columns, serves the shipped
``mme`` task as it is: its prompts, answer parsing, scoring and aggregation run unchanged, only the documents
are stand-ins. Video-MME's task reads its videos from ``$HF_HOME/videomme/data/<videoID>.mp4`` (its ``utils``)
and skips its download when ``$HF_HOME/videomme`` exists; OVO-Bench's reads its video chunks from
``$HF_HOME/ovobench/chunked_videos/<id>_<round>.mp4`` and skips its download when that folder holds mp4 files.
A dataset with a configuration name (OVO-Bench's ``forward``) gets a ``README.md`` declaring it, as on the Hub.

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
* ``kcz358/OVOBench`` (configuration ``forward``) and ``hf/ovobench/chunked_videos/*.mp4``: ``id, task,
  activity, question, test_info`` for ``ovo_forward``, lmms-eval's multi-round task
  (``generate_until_multi_round``): a clip's forward active-responding questions, one round per ``test_info``
  entry, each round on the video so far (chunk ``k``: the clip's first ``2 (k + 1)`` frames, at most all of
  them); the tasks cycle through REC (count: the clip's shapes), SSR (was a step shown) and CRR (can the
  question be answered yet), with 2 and 3 rounds alternating, so requests leave the rounds at different times;
* ``manifest.json``: what was written and ``HF_HOME`` to use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .make_tasks import data_command, quiet_datasets, write_parquet

__all__ = ["DATASETS", "HF_HOME", "expected_seedbench_ppl_acc", "main", "make_standins"]

DATASETS: dict[str, str] = {
    "mme": "lmms-lab-encoder/MME",
    "videomme": "lmms-eval/Video-MME",
    "seedbench_ppl": "lmms-lab-encoder/SEED-Bench",
    "ovo_forward": "kcz358/OVOBench",
}
"""Shipped task -> the ``dataset_path`` of its YAML (lmms-eval 0.7.3), i.e. the folder its stand-in goes in."""

CONFIGS: dict[str, str] = {"ovo_forward": "forward"}
"""Shipped task -> the ``dataset_name`` (configuration) of its YAML, where it has one."""

HF_HOME = "hf"
"""``HF_HOME`` for the run, relative to ``out`` (Video-MME's videos are under ``$HF_HOME/videomme/data``)."""

PARQUET = "data/test-00000-of-00001.parquet"
_MME_CATEGORIES = ("existence", "color", "count", "commonsense_reasoning")
_SEED_EXTRA_WORDS = ("zebra", "violin", "teapot")
_LETTERS = "ABCD"
_OVO_TASKS = ("REC", "SSR", "CRR")


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
    chunks = folder / HF_HOME / "ovobench" / "chunked_videos"
    chunks.mkdir(parents=True, exist_ok=True)
    _write(
        folder / DATASETS["ovo_forward"], _ovo_rows(n, seed, chunks), _ovo_features(), CONFIGS["ovo_forward"]
    )
    manifest = {
        "n": n,
        "seeds": [seed, seed + n - 1],
        "datasets": {task: str(_parquet(Path(path), CONFIGS.get(task))) for task, path in DATASETS.items()},
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


# ---- OVO-Bench (forward active responding: multi-round) --------------------------------------------------------
def _ovo_rows(n: int, seed: int, chunks: Path) -> list[dict[str, Any]]:
    from vlmspec.testbed import sample, write_video

    rows = []
    for i in range(n):
        clip = sample("video_caption", seed + i)
        frames = list(clip.video)
        task, rounds = _OVO_TASKS[i % len(_OVO_TASKS)], 2 + i % 2
        first = clip.scene.tracks[0].shape
        for k in range(rounds):
            write_video(chunks / f"standin{i:03d}_{k}.mp4", frames[: min(2 * (k + 1), len(frames))])
        rows.append(
            {
                "id": f"standin{i:03d}",
                "task": task,
                "activity": "show a new shape",
                "question": f"Is the {first.colour} {first.kind} still there at the end?",
                "test_info": [
                    {
                        "count": len(clip.scene.tracks),
                        "step": f"a {first.colour} {first.kind}",
                        "type": (i + k) % 2,
                    }
                    for k in range(rounds)
                ],
            }
        )
    return rows


def _ovo_features() -> Any:
    from datasets import Features, List, Value

    step = {"count": Value("int64"), "step": Value("string"), "type": Value("int64")}
    text = ("id", "task", "activity", "question")
    return Features({**{name: Value("string") for name in text}, "test_info": List(step)})


def _parquet(dataset_folder: Path, config: str | None) -> Path:
    return dataset_folder / (f"{config}/test-00000-of-00001.parquet" if config else PARQUET)


def _write(
    dataset_folder: Path, rows: list[dict[str, Any]], features: Any, config: str | None = None
) -> None:
    """The rows as the dataset's test split (of configuration ``config``, declared in a ``README.md``)."""
    path = _parquet(dataset_folder, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(path, rows, features)
    if config:
        card = f"---\nconfigs:\n- config_name: {config}\n  data_files:\n  - split: test\n    path: {config}/*.parquet\n---\n"
        (dataset_folder / "README.md").write_text(card)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = data_command("standins", __doc__, out="standins", n=4, what="documents per dataset")
    args = parser.parse_args(argv)
    quiet_datasets()
    make_standins(args.out, n=args.n, seed=args.seed)
    tasks = ",".join(DATASETS)
    print(f"wrote {args.n} stand-in documents for {tasks} to {args.out}; run lmms-eval there with "
          f"HF_HOME={Path(args.out).resolve() / HF_HOME} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
