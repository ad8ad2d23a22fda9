"""The run loop: each process captions its shard through ``pipe.batch_iter``, writing each line as its video ends;
the main process merges."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from vlmspec.errors import InvalidInputError, VLMSpecError

from .config import EXIT_OK, EXIT_PARTIAL, PROG, JobConfig, JobError
from .inputs import VideoItem, discover_inputs, frame_source
from .models import load_pipeline, run_meta
from .store import ResultWriter, is_success, merge_outputs, part_files, part_path, read_output, statuses

BARRIER_TIMEOUT = timedelta(days=7)
"""How long a process may wait at the final barrier for the others (shards can take hours)."""

ITEM_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    RuntimeError,  # decord, torch (including out-of-memory errors)
    LookupError,
    ArithmeticError,
    AssertionError,  # qwen-vl-utils checks its arguments with assert
    MemoryError,
)
"""What one video's decoding or generation may raise; recorded as an error line, then the job goes on."""


def _error_message(err: BaseException) -> str:
    text = str(err).strip() or repr(err)
    return text if len(text) <= 4000 else text[:4000] + " ..."


def item_prompt(item: VideoItem, config: JobConfig) -> str:
    """The item's own prompt, else the job's for its kind (``image_prompt`` for a picture)."""
    return item.prompt or (config.image_prompt if item.is_image else config.prompt)


def caption_request(item: VideoItem, config: JobConfig, frames: Callable[[VideoItem], Any]) -> dict[str, Any]:
    """The pipeline call for one video (its frames are read here, when the video's turn in the batch comes) or
    picture (read by the pipeline, at its turn too).

    Args:
        item: the video.
        config: the job's config.
        frames: what the pipeline's ``video=`` gets for an item (see :func:`frame_source`).

    Raises:
        InvalidInputError: the item's :attr:`~VideoItem.problem`, found before its turn.
    """
    if item.problem is not None:
        raise InvalidInputError(item.problem)
    common = {
        "prompt": item_prompt(item, config),
        "max_new_tokens": config.max_new_tokens,
        "structured_outputs": config.structured_outputs,
    }
    if item.is_image:
        return {**common, "image": item.path}
    return {**common, "video": frames(item), "num_frames": config.num_frames}


def _error_type(error: BaseException) -> str:
    """The error's class name, the built-in one for the library's own errors (``InvalidInputError`` is recorded as
    ``ValueError``), so the documented ``error_type`` values stay what they were."""
    if isinstance(error, VLMSpecError):
        return next(
            c.__name__ for c in type(error).__mro__ if c.__module__ == "builtins" and c is not Exception
        )
    return type(error).__name__


def caption_record(item: VideoItem, config: JobConfig, meta: dict[str, Any], result: Any) -> dict[str, Any]:
    """The output record of one video from its pipeline result: ``caption`` and ``stats``, or, for a failure
    (``ITEM_ERRORS``), ``error`` and ``error_type``; any other exception propagates.

    Args:
        item: the video.
        config: the job's config.
        meta: ``policy``/``settings``/``model`` fields shared by every record.
        result: a :class:`~vlmspec.pipeline.SpecOutput`, or the exception its request raised.
    """
    base = {"id": item.id, "path": item.path, **item.window, "prompt": item_prompt(item, config)}
    if not isinstance(result, BaseException) and result.reasoning is not None and not result.content.strip():
        result = InvalidInputError(  # a failure, so that a rerun tries the video again
            f"no caption: the reply ended while reasoning, after {len(result.token_ids)} tokens; give the model "
            f"more than max_new_tokens={config.max_new_tokens}"
        )
    if isinstance(result, ITEM_ERRORS):
        return {**base, "error": _error_message(result), "error_type": _error_type(result), **meta}
    if isinstance(result, BaseException):
        raise result
    stats = result.stats.to_dict()
    if not config.trace:
        stats.pop("trace", None)
    thinking = {} if result.reasoning is None else {"reasoning": result.reasoning}  # the caption: the answer
    return {**base, "caption": result.content, **thinking, **meta, "stats": stats}


@dataclass
class RunTotals:
    """What one process did in this run."""

    processed: int = 0
    captioned: int = 0
    failed: int = 0
    skipped: int = 0
    new_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    seconds: float = 0.0

    def add(self, record: dict[str, Any]) -> None:
        self.processed += 1
        if not is_success(record):
            self.failed += 1
            return
        self.captioned += 1
        stats = record.get("stats", {})
        self.new_tokens += int(stats.get("new_tokens", 0))
        self.steps += int(stats.get("steps", 0))
        self.accepted += int(stats.get("accepted_tokens", 0))

    @classmethod
    def combine(cls, parts: Sequence[RunTotals]) -> RunTotals:
        """Sums over processes; ``seconds`` is the slowest process's."""
        total = cls()
        for part in parts:
            for name in ("processed", "captioned", "failed", "skipped", "new_tokens", "steps", "accepted"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.seconds = max(total.seconds, part.seconds)
        return total

    @property
    def tau(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


@dataclass
class JobSummary:
    """The job's outcome over its inputs, and this run's speed.

    Attributes:
        videos: inputs.
        succeeded: inputs with a caption in the output.
        failed: inputs with only an error line.
        missing: inputs with no line (only if a process died without raising).
        run: this run's totals over all processes.
        policy: this run's decoding policy.
        out: the output file.
        earlier: what the inputs' lines written with other settings (an earlier run's) hold; empty when every
            line has this run's settings.
    """

    videos: int
    succeeded: int
    failed: int
    missing: int
    run: RunTotals
    policy: str
    out: str
    earlier: OtherSettings | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.succeeded == self.videos else EXIT_PARTIAL

    def to_dict(self) -> dict[str, Any]:
        seconds = self.run.seconds
        return {
            "videos": self.videos,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "missing": self.missing,
            "processed": self.run.processed,
            "skipped": self.run.skipped,
            # captioned videos only: a failed one is not a video done
            "videos_per_second": self.run.captioned / seconds if seconds > 0 else 0.0,
            "tokens_per_second": self.run.new_tokens / seconds if seconds > 0 else 0.0,
            "mean_tau": self.run.tau,
            "new_tokens": self.run.new_tokens,
            "seconds": seconds,
            "policy": self.policy,
            "other_settings": self.earlier.lines if self.earlier else 0,
            "out": self.out,
        }

    def line(self) -> str:
        """The summary line."""
        d = self.to_dict()
        missing = f", {self.missing} missing" if self.missing else ""
        return (
            f"summary: {self.videos} videos: {self.succeeded} succeeded, {self.failed} failed{missing} "
            f"(this run: {self.run.captioned} captioned, {self.run.failed} failed, {self.run.skipped} already done) | "
            f"{d['videos_per_second']:.2f} captioned videos/s, {d['tokens_per_second']:.1f} tokens/s, mean tau "
            f"{d['mean_tau']:.2f} | {self._settings()} | {self.out}"
        )

    def _settings(self) -> str:
        """Which settings made the inputs' lines: this run's policy, unless lines came from an earlier run with
        other settings (then says so, and never claims this run's settings for them)."""
        earlier = self.earlier
        if not earlier:
            return f"policy {self.policy}"
        lines = self.succeeded + self.failed
        what = f"other settings ({earlier.describe()})"
        if earlier.lines >= lines:
            return f"every line from an earlier run with {what}, none with this run's (policy {self.policy})"
        return f"policy {self.policy}; {earlier.lines} of {lines} lines from an earlier run with {what}"


def _state(cpu: bool) -> Any:
    """accelerate's ``PartialState`` (one process unless launched by ``accelerate launch``)."""
    import torch
    from accelerate import PartialState

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched <= 1:
        return PartialState(cpu=cpu)
    # Without a GPU, accelerate sets up several processes only in CPU mode (else each would think it is alone).
    state = PartialState(cpu=cpu or not torch.cuda.is_available(), timeout=BARRIER_TIMEOUT)
    if state.num_processes != launched:
        raise JobError(
            f"launched as {launched} processes (WORLD_SIZE) but accelerate set up {state.num_processes}; every "
            "process would caption every video. On CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            "--num_processes N ..., or torchrun --nproc_per_node N ..."
        )
    return state


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _todo(
    shard: Sequence[VideoItem], status: dict[str, str], retry_errors: bool
) -> tuple[list[VideoItem], set[str]]:
    """The shard's videos still to caption and, among them, the ids whose error lines are retried."""
    todo, retried = [], set()
    for item in shard:
        state = status.get(item.id)
        if state == "ok" or (state == "error" and not retry_errors):
            continue
        todo.append(item)
        if state == "error":
            retried.add(item.id)
    return todo, retried


@dataclass(frozen=True)
class OtherSettings:
    """Lines written with settings other than this run's.

    Attributes:
        lines: how many.
        fields: what differs: ``policy``, ``model``, or the ``settings`` keys, sorted.
        policies: the policies they were written with, sorted.
    """

    lines: int
    fields: tuple[str, ...]
    policies: tuple[str, ...]

    def __bool__(self) -> bool:
        return self.lines > 0

    def describe(self) -> str:
        """E.g. ``policy sage; differing: max_new_tokens, policy``."""
        return f"policy {', '.join(self.policies) or '?'}; differing: {', '.join(self.fields)}"

    @classmethod
    def of(cls, records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> OtherSettings:
        """The records among ``records`` whose ``policy``, ``settings`` or ``model`` differ from ``meta``'s."""
        lines, fields, policies = 0, set(), set()
        for record in records:
            differing = _differing(record, meta)
            if differing:
                lines += 1
                fields.update(differing)
                policies.add(str(record.get("policy")))
        return cls(lines, tuple(sorted(fields)), tuple(sorted(policies)))


def _differing(record: dict[str, Any], meta: dict[str, Any]) -> set[str]:
    """The names of what ``record`` was written with that differs from ``meta``."""
    out = {key for key in ("policy", "model") if record.get(key) != meta[key]}
    settings = record.get("settings")
    if settings != meta["settings"]:
        if isinstance(settings, dict):
            keys = set(settings) | set(meta["settings"])
            out.update(k for k in keys if settings.get(k) != meta["settings"].get(k))
        else:
            out.add("settings")
    return out


def _warn_other_settings(records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Warns when captions in the output (its part files included) were made with other settings: they are kept
    and skipped, whether or not anything is left to caption."""
    other = OtherSettings.of([r for r in records if is_success(r)], meta)
    if other:
        print(
            f"{PROG}: warning: {other.lines} video(s) already captioned in the output used other models or settings "
            f"({other.describe()}); they are kept and skipped (use a new --out to caption everything with the "
            "current settings)",
            file=sys.stderr,
        )


def _progress(total: int, rank: int, world: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="video",
        desc="captioning" if world == 1 else f"captioning [rank {rank}]",
        position=rank if world > 1 else None,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def _caption_shard(
    pipe: Any,
    todo: Sequence[VideoItem],
    config: JobConfig,
    writer: ResultWriter,
    meta: dict[str, Any],
    bar: Any,
) -> RunTotals:
    """Captions ``todo``, ``config.batch_size`` videos decoding together (default: the pipeline's choice), one
    line per video written as soon as it is captioned; updates the progress bar."""
    from tqdm.auto import tqdm

    frames = frame_source(config, pipe)
    batch_size = config.batch_size or pipe.default_batch_size()
    totals = RunTotals()
    start = time.perf_counter()
    requests = [partial(caption_request, item, config, frames) for item in todo]  # a list: no rows beyond it
    for index, result in pipe.batch_iter(requests, batch_size):
        item = todo[index]
        record = caption_record(item, config, meta, result)
        try:
            writer.write(record)
        except OSError as err:
            raise JobError(
                f"could not append to {str(writer.path)!r} ({err}); fix that (disk space?) and rerun the same "
                "command to resume"
            ) from err
        totals.add(record)
        totals.seconds = time.perf_counter() - start
        if not is_success(record):
            tqdm.write(f"{PROG}: {item.id}: {record['error_type']}: {record['error']}", file=sys.stderr)
        bar.set_postfix(
            {"tok/s": f"{totals.new_tokens / max(totals.seconds, 1e-9):.1f}", "tau": f"{totals.tau:.2f}",
             "failed": totals.failed},
            refresh=False,
        )  # fmt: skip
        bar.update(1)
    return totals


def run_job(config: JobConfig, source: str | Path, out: str | Path, cpu: bool = False) -> JobSummary | None:
    """Captions every video of ``source`` into ``out``, resuming what an earlier run left.

    Args:
        config: the job's config.
        source: a folder, a glob or a manifest (see :func:`discover_inputs`).
        out: the output JSONL file.
        cpu: keep models on the CPU even if there is a GPU (also ``ACCELERATE_USE_CPU=1``).

    Returns:
        The summary on the main process; ``None`` on the other processes of a multi-process launch.

    Raises:
        JobError: the job cannot run (the message says why).
    """
    out = Path(out)
    if out.is_dir():
        raise JobError(f"--out {str(out)!r} is a folder; name the output .jsonl file")
    items = discover_inputs(source, config.extensions, config.segment)
    cpu = cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    state = _state(cpu)
    rank, world = state.process_index, state.num_processes
    own = out if world == 1 else part_path(out, rank)
    with state.split_between_processes(items) as shard:
        shard = list(shard)
    totals = RunTotals()
    with _torch_threads(config.threads):
        meta = run_meta(config)  # what this run's lines carry; names resolved, nothing loaded
    with ResultWriter(own) as writer:  # locked before reading what is done: a second job on `own` stops here
        todo, records = _plan(writer, out, shard, config.retry_errors)
        totals.skipped = len(shard) - len(todo)
        where = f" (process {rank} of {world}: {len(shard)} of the {len(items)} videos)" if world > 1 else ""
        print(
            f"{PROG}: {totals.skipped} already done, {len(todo)} to caption{where} -> {own}", file=sys.stderr
        )
        _warn_other_settings(records, meta)
        if todo:
            with _torch_threads(config.threads):
                pipe, _ = load_pipeline(
                    config, device_map=config.device_map or ({"": "cpu"} if cpu else None)
                )
                with _progress(len(todo), rank, world, config.progress) as bar:
                    totals = RunTotals.combine(
                        [totals, _caption_shard(pipe, todo, config, writer, meta, bar)]
                    )
    if world > 1:
        from accelerate.utils import gather_object

        totals = RunTotals.combine([RunTotals(**d) for d in gather_object([asdict(totals)])])
        state.wait_for_everyone()
    if not state.is_main_process:
        return None
    return _summarize(merge_outputs(out, items), items, totals, meta, out)


def _plan(
    writer: ResultWriter, out: Path, shard: Sequence[VideoItem], retry_errors: bool
) -> tuple[list[VideoItem], list[dict[str, Any]]]:
    """What this process still has to caption, from ``<out>`` and every part file.

    The writer's own file is repaired (torn last line) and, when error lines are retried, rewritten without
    them; the other files are only read (a torn last line there is ignored).

    Returns:
        The videos to caption and every record read (for the settings check).
    """
    own_records = read_output(writer.path, repair=True)
    others = [path for path in [out] + part_files(out) if path != writer.path]
    records = [r for path in others for r in read_output(path, repair=False)] + own_records
    todo, retried = _todo(shard, statuses(records), retry_errors)
    if retried:
        print(f"{PROG}: retrying {len(retried)} video(s) that failed before", file=sys.stderr)
        if any(str(r["id"]) in retried for r in own_records):
            writer.rewrite([r for r in own_records if str(r["id"]) not in retried])
    return todo, records


def _summarize(
    merged: Sequence[dict[str, Any]],
    items: Sequence[VideoItem],
    totals: RunTotals,
    meta: dict[str, Any],
    out: Path,
) -> JobSummary:
    final = statuses(merged)
    ids = {i.id for i in items}
    succeeded = sum(1 for i in items if final.get(i.id) == "ok")
    failed = sum(1 for i in items if final.get(i.id) == "error")
    return JobSummary(
        videos=len(items),
        succeeded=succeeded,
        failed=failed,
        missing=len(items) - succeeded - failed,
        run=totals,
        policy=meta["policy"],
        out=str(out),
        earlier=OtherSettings.of([r for r in merged if str(r["id"]) in ids], meta),
    )
