"""Speed metrics of an lmms-eval run: per-request stats, per-task aggregates, files and the printed summary.

Every generation request (every round of a multi-round request) records its :class:`~vlmspec.engine.SpecStats`
as a :class:`SampleSpeed`. When lmms-eval
has answered all requests it calls the model's ``clean()`` on every rank; the model then gathers the records of
all ranks and rank 0 writes one ``vlmspec_speed_<task>.json`` per task (aggregate + per-sample records) into the
output folder and prints the summary (see :mod:`vlmspec_eval.lmms.model`).

Per task:

* ``tau``: accepted draft tokens per verification step (bonus token excluded), pooled over the task's requests;
* ``tokens_per_step``: tokens emitted per target forward (tau + 1 unless a stop condition cut the step);
* ``tokens_per_second``: generated tokens / the task's share of the generation wall time, pooled. At
  ``batch_size`` > 1 requests decode side by side, so each request's own time (``total_seconds``) overlaps the
  others'; its share (``wall_seconds``, :func:`shared_wall_seconds`) splits every moment evenly among the
  requests running then, so the shares add up to the wall time;
* ``speedup``: with ``ar_reference`` (the output folder of an earlier ``policy=ar`` run on the same documents),
  the AR run's wall-time shares over this run's, on the documents both ran, measured; also how many outputs are
  identical to the AR run's (lossless check);
* ``speedup_est`` (always): an estimate from this run alone, ``(prefill + (new_tokens - 1) x mean verify step) /
  total time``, i.e. AR decoding priced at one verification forward per token. It ignores that a tree forward
  costs more than a one-token forward, so it overstates the speed-up where that difference matters (CPU, tiny
  models); use ``ar_reference`` for figures to report.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from loguru import logger

from vlmspec.errors import InvalidInputError

__all__ = [
    "SPEED_FILE",
    "SampleSpeed",
    "accuracy_by_task",
    "compare_with_reference",
    "find_results",
    "format_summary",
    "load_reference",
    "summarize",
    "task_reports",
    "write_reports",
]

SPEED_FILE = "vlmspec_speed_{task}.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class SampleSpeed:
    """Speed statistics of one generation request."""

    task: str
    split: str | None
    doc_id: int
    policy: str
    new_tokens: int
    steps: int
    accepted_tokens: int
    tokens_per_step: float
    total_seconds: float
    prefill_seconds: float
    draft_prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    tree_nodes: int
    target_visual_tokens: int
    draft_visual_tokens: int
    lossless: bool
    output_sha1: str
    round: int = 0
    """The round of a multi-round request (``generate_until_multi_round``); 0 for every other request."""
    settings_sha1: str | None = None
    """A digest of the request's generation settings (``max_new_tokens``, sampling, stop strings, ...), so that a
    comparison with a reference run can tell runs of other settings; ``None`` in files written before it."""
    wall_seconds: float | None = None
    """The request's share of the wall time (:func:`shared_wall_seconds`); ``None``: its own time (batch size 1,
    or a file written before the field existed)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens taken from the prefix cache (``prefix_cache_gb``) instead of prefilled."""

    @property
    def seconds(self) -> float:
        """What the request cost the run: its share of the wall time."""
        return self.total_seconds if self.wall_seconds is None else self.wall_seconds

    @classmethod
    def from_stats(
        cls,
        task: str,
        split: str | None,
        doc_id: int,
        stats: Any,
        token_ids: Sequence[int],
        round_idx: int = 0,
        settings: Any = None,
    ) -> SampleSpeed:
        """A record from a pipeline call's ``stats`` and generated ``token_ids`` (of round ``round_idx``)."""
        return cls(
            task=task,
            split=split,
            doc_id=int(doc_id),
            policy=stats.policy,
            new_tokens=int(stats.new_tokens),
            steps=int(stats.steps),
            accepted_tokens=int(stats.accepted_tokens),
            tokens_per_step=float(stats.tokens_per_step),
            total_seconds=float(stats.total_seconds),
            prefill_seconds=float(stats.prefill_seconds),
            draft_prefill_seconds=float(stats.draft_prefill_seconds),
            draft_seconds=float(stats.draft_seconds),
            verify_seconds=float(stats.verify_seconds),
            tree_nodes=int(sum(stats.tree_sizes)),
            target_visual_tokens=int(stats.target_visual_tokens),
            draft_visual_tokens=int(stats.draft_visual_tokens),
            lossless=bool(stats.lossless),
            output_sha1=_digest(json.dumps([int(t) for t in token_ids])),
            round=int(round_idx),
            settings_sha1=_digest(repr(settings)) if settings is not None else None,
            cached_prompt_tokens=int(stats.cached_prompt_tokens),
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SampleSpeed:
        """Inverse of ``asdict`` (extra keys ignored, so newer files still load; missing optional fields take
        their defaults)."""
        optional = {"round", "wall_seconds", "settings_sha1", "cached_prompt_tokens"}
        return cls(
            **{f.name: values[f.name] for f in fields(cls) if f.name in values or f.name not in optional}
        )

    @property
    def key(self) -> tuple[str | None, int, int]:
        """Identifies the document (and the round of a multi-round request) within its task."""
        return self.split, self.doc_id, self.round


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def dedupe(samples: Iterable[SampleSpeed]) -> list[SampleSpeed]:
    """One record per (task, split, doc_id, round), the first one kept, sorted by document and round."""
    seen: dict[tuple[str, str | None, int, int], SampleSpeed] = {}
    for sample in samples:
        seen.setdefault((sample.task, *sample.key), sample)
    return sorted(seen.values(), key=lambda s: (s.task, str(s.split), s.doc_id, s.round))


def shared_wall_seconds(spans: Sequence[tuple[float, float]]) -> list[float]:
    """Each request's share of the wall time, from the ``(start, end)`` times of requests that ran side by side:
    every moment is split evenly among the requests running then, so the shares add up to the time any of them
    ran, and a request that ran alone gets its own time."""
    times = sorted({t for span in spans for t in span})
    index = {t: i for i, t in enumerate(times)}
    running = [0] * (len(times) + 1)  # difference array: requests running from times[i] to times[i + 1]
    for start, end in spans:
        running[index[start]] += 1
        running[index[end]] -= 1
    cumulative, live = [0.0], 0  # cumulative[i]: one request's share from times[0] to times[i]
    for i in range(len(times) - 1):
        live += running[i]
        cumulative.append(cumulative[-1] + ((times[i + 1] - times[i]) / live if live else 0.0))
    return [cumulative[index[end]] - cumulative[index[start]] for start, end in spans]


def summarize(samples: Sequence[SampleSpeed]) -> dict[str, Any]:
    """Pooled speed metrics of one task's requests (see the module docstring)."""
    steps = sum(s.steps for s in samples)
    seconds = sum(s.seconds for s in samples)
    new_tokens = sum(s.new_tokens for s in samples)
    estimated_ar = sum(
        _estimated_ar_seconds(s) * s.seconds / s.total_seconds for s in samples if s.total_seconds
    )
    return {
        "n_samples": len(samples),
        "new_tokens": new_tokens,
        "steps": steps,
        "tau": sum(s.accepted_tokens for s in samples) / steps if steps else 0.0,
        "tokens_per_step": sum(s.tokens_per_step * s.steps for s in samples) / steps if steps else 0.0,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else 0.0,
        "mean_tree_size": sum(s.tree_nodes for s in samples) / steps if steps else 0.0,
        "total_seconds": sum(s.total_seconds for s in samples),
        "wall_seconds": seconds,
        "prefill_seconds": sum(s.prefill_seconds for s in samples),
        "draft_prefill_seconds": sum(s.draft_prefill_seconds for s in samples),
        "draft_seconds": sum(s.draft_seconds for s in samples),
        "verify_seconds": sum(s.verify_seconds for s in samples),
        "speedup_est": estimated_ar / seconds if seconds > 0 else 0.0,
        "target_visual_tokens": sum(s.target_visual_tokens for s in samples),
        "draft_visual_tokens": sum(s.draft_visual_tokens for s in samples),
        "lossless": all(s.lossless for s in samples),
    }


def _estimated_ar_seconds(sample: SampleSpeed) -> float:
    if sample.steps == 0:
        return sample.total_seconds
    return sample.prefill_seconds + (sample.new_tokens - 1) * sample.verify_seconds / sample.steps


def compare_with_reference(
    samples: Sequence[SampleSpeed], reference: Sequence[SampleSpeed]
) -> dict[str, Any]:
    """Measured speed-up over an AR run on the documents both runs answered, and the lossless check."""
    by_key = {r.key: r for r in reference}
    pairs = [(s, by_key[s.key]) for s in samples if s.key in by_key]
    own = sum(s.seconds for s, _ in pairs)
    ref = sum(r.seconds for _, r in pairs)
    ref_tokens = sum(r.new_tokens for _, r in pairs)
    return {
        "n_matched": len(pairs),
        "reference_policy": sorted({r.policy for _, r in pairs}),
        "reference_tokens_per_second": ref_tokens / ref if ref > 0 else 0.0,
        "speedup": ref / own if own > 0 else 0.0,
        "identical_outputs": sum(s.output_sha1 == r.output_sha1 for s, r in pairs),
        "other_settings": sum(
            None not in (s.settings_sha1, r.settings_sha1) and s.settings_sha1 != r.settings_sha1
            for s, r in pairs
        ),
    }


def task_reports(
    samples: Iterable[SampleSpeed],
    run: Mapping[str, Any],
    reference: Mapping[str, Sequence[SampleSpeed]] | None = None,
) -> dict[str, dict[str, Any]]:
    """One report per task: ``{"task", "run", "metrics", "reference", "samples"}``.

    Args:
        samples: the records of all ranks (duplicates from lmms-eval's rank padding are dropped).
        run: what ran (model options, world size, ...), stored as is.
        reference: per task, the records of an AR run to compare with.
    """
    by_task: dict[str, list[SampleSpeed]] = defaultdict(list)
    for sample in dedupe(samples):
        by_task[sample.task].append(sample)
    reports = {}
    for task, task_samples in sorted(by_task.items()):
        ref = (reference or {}).get(task)
        reports[task] = {
            "format_version": FORMAT_VERSION,
            "task": task,
            "run": dict(run),
            "metrics": summarize(task_samples),
            "reference": compare_with_reference(task_samples, ref) if ref else None,
            "samples": [asdict(s) for s in task_samples],
        }
    return reports


def write_reports(reports: Mapping[str, Mapping[str, Any]], folder: str | Path) -> list[Path]:
    """Write ``vlmspec_speed_<task>.json`` files into ``folder`` (created if needed)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, report in reports.items():
        path = out / SPEED_FILE.format(task=task)
        path.write_text(json.dumps(report, indent=2) + "\n")
        paths.append(path)
    return paths


def check_speed_dir(folder: str | Path) -> None:
    """Create ``folder`` (``speed_dir``; lmms-eval writes its results there too) when the model is built, so that
    one that cannot be written fails before any generation rather than after all of it.

    Raises:
        InvalidInputError: naming the folder and why.
    """
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidInputError(
            f"speed_dir={str(folder)!r} cannot be created ({err.strerror or err}); give a folder you can write to"
        ) from None
    if not os.access(path, os.W_OK):
        raise InvalidInputError(f"speed_dir={str(folder)!r} is not writable; give a folder you can write to")


def check_reference(location: str | Path) -> None:
    """Refuse, when the model is built (before any generation), an ``ar_reference`` that cannot serve: a location
    that does not exist, holds no speed file, holds one that is not JSON, or one of a run other than ``policy=ar``.

    Raises:
        FileNotFoundError: nothing there. ValueError: the rest, naming the file.
    """
    path = Path(location).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"ar_reference={str(location)!r} does not exist")
    files = [path] if path.is_file() else _speed_files(path, "*")
    if not files:
        raise FileNotFoundError(
            f"ar_reference={str(location)!r} holds no {SPEED_FILE.format(task='<task>')}: give the output folder "
            "of an earlier policy=ar run"
        )
    for file in files:
        policy = _read_report(file, location).get("run", {}).get("policy")
        if policy != "ar":
            raise ValueError(
                f"ar_reference={str(location)!r}: {file.name} is a policy={policy!r} run; the speed-up needs a "
                "policy=ar run on the same documents"
            )


def load_reference(location: str | Path, tasks: Iterable[str]) -> dict[str, list[SampleSpeed]]:
    """The AR records per task from an earlier run's folder (or one ``vlmspec_speed_<task>.json`` file), checked
    by :func:`check_reference`; a task without one gets no speed-up (a logged warning names it)."""
    path = Path(location).expanduser()
    files = [path] if path.is_file() else [p for t in tasks for p in _speed_files(path, t)]
    found: dict[str, list[SampleSpeed]] = {}
    for file in files:
        report = _read_report(file, location)
        found.setdefault(report["task"], [SampleSpeed.from_dict(s) for s in report["samples"]])
    if missing := sorted(set(tasks) - set(found)):  # logged: lmms-eval turns Python's warnings off
        logger.warning(f"ar_reference={str(location)!r} holds no AR run of {missing}: no speed-up for them")
    return found


def _read_report(file: Path, location: str | Path) -> dict[str, Any]:
    try:
        report = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"ar_reference={str(location)!r}: {file.name} is not a speed file ({err})") from None
    if not isinstance(report, dict) or "task" not in report or "samples" not in report:
        raise ValueError(f"ar_reference={str(location)!r}: {file.name} is not a vlmspec speed file")
    return report


def _speed_files(folder: Path, task: str) -> list[Path]:
    name = SPEED_FILE.format(task=task)
    return sorted(folder.glob(name)) + sorted(folder.glob(f"*/{name}"))


# ---------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------
def find_results(folder: str | Path, since: float) -> dict[str, Any] | None:
    """The newest lmms-eval ``*_results.json`` under ``folder`` written after ``since`` (a ``time.time()``)."""
    candidates = [p for p in Path(folder).glob("**/*_results.json") if p.stat().st_mtime >= since]
    if not candidates:
        return None
    return json.loads(max(candidates, key=lambda p: p.stat().st_mtime).read_text())


def accuracy_by_task(results: Mapping[str, Any] | None) -> dict[str, str]:
    """``task -> "metric value, ..."`` from lmms-eval's results (stderr and alias entries left out)."""
    if not results:
        return {}
    out = {}
    for task, metrics in results.get("results", {}).items():
        parts = []
        for key, value in metrics.items():
            name = key.split(",")[0]
            if (
                name == "alias"
                or "_stderr" in name
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                continue
            parts.append(f"{name} {value:.4g}")
        out[task] = ", ".join(parts)
    return out


def format_summary(
    reports: Mapping[str, Mapping[str, Any]], accuracy: Mapping[str, str] | None = None
) -> str:
    """The printed summary: one row per task (accuracy when known, tau, tokens/step, tokens/s, speed-up)."""
    accuracy = accuracy or {}
    header = ["task", "n", "policy", "tau", "tok/step", "tok/s", "speed-up"]
    if accuracy:
        header.insert(1, "accuracy")
    rows = []
    for task, report in reports.items():
        m, ref = report["metrics"], report.get("reference")
        speedup = (
            f"{ref['speedup']:.2f}x vs AR ({ref['identical_outputs']}/{ref['n_matched']} identical"
            + (
                f"; {ref['other_settings']} decoded with other settings: not comparable)"
                if ref.get("other_settings")
                else ")"
            )
            if ref
            else f"~{m['speedup_est']:.2f}x (est.)"
        )
        row = [task, str(m["n_samples"]), str(report["run"].get("policy", "?")), f"{m['tau']:.2f}",
               f"{m['tokens_per_step']:.2f}", f"{m['tokens_per_second']:.1f}", speedup]  # fmt: skip
        if accuracy:
            row.insert(1, accuracy.get(task, "-"))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in [header, *rows]
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
