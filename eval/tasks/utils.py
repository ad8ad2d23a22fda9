"""Document functions and scoring of the local vlmspec tasks (loaded by lmms-eval through ``!function utils.*``).

Data: ``data/*.parquet`` next to this file, written by ``python -m vlmspec_eval.lmms.make_tasks``. Images and
video frames are embedded in the parquet files; ``video`` holds an mp4 path relative to the data folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmspec_eval.lmms.text_metrics import exact_match, rouge_l, token_f1

DATA_DIR = Path(__file__).resolve().parent / "data"


def _text(doc: dict[str, Any], key: str, lmms_eval_specific_kwargs: dict[str, Any] | None) -> str:
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc[key]}{kwargs.get('post_prompt', '')}"


def image_doc_to_visual(doc: dict[str, Any]) -> list[Any]:
    """The document's picture."""
    return [doc["image"].convert("RGB")]


def video_doc_to_visual(doc: dict[str, Any]) -> list[str]:
    """The document's clip as an mp4 path (decoded by the model, ``num_frames`` sampled evenly)."""
    path = Path(doc["video"])
    return [str(path if path.is_absolute() else DATA_DIR / path)]


def frames_doc_to_visual(doc: dict[str, Any]) -> list[list[Any]]:
    """The document's clip as one visual holding its list of frames."""
    return [[frame.convert("RGB") for frame in doc["frames"]]]


def frames_doc_to_messages(
    doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Chat messages with the clip as frames (lmms-eval's default messages take one visual per part)."""
    frames = frames_doc_to_visual(doc)[0]
    text = _text(doc, "prompt", lmms_eval_specific_kwargs)
    return [{"role": "user", "content": [{"type": "video", "url": frames}, {"type": "text", "text": text}]}]


def qa_doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    """The question."""
    return _text(doc, "question", lmms_eval_specific_kwargs)


def caption_doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    """The captioning prompt."""
    return _text(doc, "prompt", lmms_eval_specific_kwargs)


def qa_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Exact match (normalized) and token F1 of the answer."""
    answer = results[0] if results else ""
    return {"exact_match": exact_match(answer, doc["answer"]), "token_f1": token_f1(answer, doc["answer"])}


def caption_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """ROUGE-L and token F1 of the caption."""
    caption = results[0] if results else ""
    return {"rouge_l": rouge_l(caption, doc["caption"]), "token_f1": token_f1(caption, doc["caption"])}
