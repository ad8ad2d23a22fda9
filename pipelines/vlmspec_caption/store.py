"""The output file: append-only fsynced lines, torn-tail repair, atomic rewrite, and the merge of part files."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmspec.artifacts import fsync_dir, write_atomic

from .config import PROG, JobError
from .inputs import VideoItem


def encode_record(record: dict[str, Any]) -> bytes:
    """One output line: compact JSON (non-finite floats as ``null``) and a newline, UTF-8. A text that UTF-8
    cannot hold (a file name that is not UTF-8 reaches Python with lone surrogates) is written as JSON escapes,
    which read back to the same string."""
    ordered = _finite({"id": record["id"], **record})  # the id first: how the job recognises its own lines
    try:
        return (json.dumps(ordered, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(ordered, allow_nan=False) + "\n").encode("ascii")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_PART_RE = re.compile(r"\.part(\d+)$")


@dataclass
class ScannedFile:
    """An output file's complete records and where its valid part ends.

    Attributes:
        records: the parsed lines (JSON objects with an ``id``), in file order.
        valid_bytes: length of the valid part; beyond it lies a torn last line.
        size: the file's size.
    """

    records: list[dict[str, Any]]
    valid_bytes: int
    size: int

    @property
    def torn(self) -> bool:
        return self.valid_bytes < self.size


def _parse_line(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "id" in record else None


RECORD_START = b'{"id": '
"""How every line this job writes begins (:func:`encode_record`: the record's first key is its id)."""


def _torn_record(piece: bytes, after_lines: bool) -> bool:
    """Whether ``piece`` (what follows the last newline) can be a line of this job cut short: the start of a
    record; or, after complete lines (which must then be the job's records), however few of a record's bytes
    reached the disk, or zero bytes a crash left in their place. (A file of zero bytes alone, or of ``{``, is not
    taken for the job's.)"""
    if not piece or piece.startswith(RECORD_START):
        return True
    piece = piece.rstrip(b"\0")
    return after_lines and (piece.startswith(RECORD_START) or RECORD_START.startswith(piece))


def _not_ours(file: Path, line: int) -> JobError:
    return JobError(
        f"output file {str(file)!r} was not written by this job (line {line} is not one of its records); it is left "
        "unchanged: pass another --out, or move that file away"
    )


def is_caption_record(record: dict[str, Any]) -> bool:
    """A line of the caption job: a video's ``caption`` or its ``error`` (not a batch job's ``response``)."""
    return ("caption" in record or "error" in record) and "response" not in record


def scan_output(path: str | Path, ours: Callable[[dict[str, Any]], bool] = is_caption_record) -> ScannedFile:
    """Parses an output file; a torn last line (a record cut short: no newline, or not parsable) is set aside.

    Only the job's own files are taken: a path that is not a regular file, or a file whose lines are not the job's
    records (each starts with :data:`RECORD_START`, and is one ``ours`` takes: another job's output is not), is
    refused without reading further or changing a byte.

    Raises:
        JobError: not a regular file, not written by this job, or a damaged line before the last one.
    """
    file = Path(path)
    if file.exists() and not file.is_file():
        raise JobError(
            f"output {str(file)!r} is not a regular file (a folder, device or pipe); the job writes only to a "
            "regular file, new or one it wrote before: pass a .jsonl file path to --out"
        )
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return ScannedFile([], 0, 0)
    except OSError as err:
        raise JobError(f"output file {str(file)!r} could not be read: {err}") from err
    lines = data.split(b"\n")
    if not _torn_record(lines[-1], any(line.strip() for line in lines[:-1])):
        raise _not_ours(file, len(lines))
    complete = lines[:-1]  # the last piece follows the last newline: empty, or a line torn before its newline
    records: list[dict[str, Any]] = []
    offset = valid = 0
    for number, line in enumerate(complete, start=1):
        offset += len(line) + 1
        if not line.strip():
            valid = offset
            continue
        record = _parse_line(line)
        if record is None:
            if not records and not line.startswith(RECORD_START):
                raise _not_ours(file, number)
            if number == len(complete) and not lines[-1] and line.startswith(RECORD_START):
                break  # the last line is torn (unparsable): truncated away
            raise JobError(
                f"output file {str(file)!r} line {number} is not a JSON object with an 'id'; it was damaged or "
                "edited (this job only writes whole lines): fix or delete that line, then rerun"
            )
        if not ours(record):
            raise _not_ours(file, number)
        records.append(record)
        valid = offset
    return ScannedFile(records, valid, len(data))


def read_output(
    path: str | Path,
    repair: bool,
    prog: str = PROG,
    ours: Callable[[dict[str, Any]], bool] = is_caption_record,
) -> list[dict[str, Any]]:
    """The records of an output file.

    Args:
        path: the file (missing: no records).
        repair: truncate a torn last line away (only for a file this process owns); else just ignore it.
        prog, ours: the job whose output it is: its command, which the repair's message names, and which records
            are its own (:func:`scan_output`; another job keeps its output here too).

    Raises:
        JobError: a damaged line before the last one.
    """
    scanned = scan_output(path, ours)
    if repair and scanned.torn:
        with open(path, "r+b") as handle:
            handle.truncate(scanned.valid_bytes)
            handle.flush()
            os.fsync(handle.fileno())
        print(
            f"{prog}: {path}: removed a torn last line ({scanned.size - scanned.valid_bytes} bytes) left by an "
            "interrupted run; its item is done again",
            file=sys.stderr,
        )
    return scanned.records


class ResultWriter:
    """Appends whole lines to an output file: one ``os.write`` of the encoded line, then ``os.fsync``.

    The file is opened with ``O_APPEND`` and locked (``flock``) so that a second job cannot write the same file.
    A process killed at any point leaves every earlier line whole; a line cut short by a crash has no newline and
    is truncated away on the next start (:func:`read_output` with ``repair=True``).

    Raises:
        JobError: the file is locked by another running job or cannot be opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a file where a folder should be, or a folder that cannot be made
            raise JobError(
                f"output file {str(self.path)!r} cannot be created: its folder {str(self.path.parent)!r} cannot be "
                f"made ({err.strerror}: {err.filename!r}); choose another --out"
            ) from err
        existed = self.path.exists()
        if existed and not self.path.is_file():  # a pipe would block the open until a reader comes
            raise JobError(
                f"output {str(self.path)!r} is not a regular file; pass a .jsonl file path to --out"
            )
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            raise JobError(f"output file {str(self.path)!r} cannot be opened for writing: {err}") from err
        try:
            _lock(self._fd, self.path)
        except JobError:
            self.close()
            raise
        if not existed:
            fsync_dir(self.path.parent)

    def write(self, record: dict[str, Any]) -> None:
        """Appends ``record`` as one line and makes it durable.

        Raises:
            OSError: the write failed or was short (disk full); the partial line is repaired on restart.
        """
        if self._fd is None:
            raise ValueError(f"ResultWriter for {self.path} is closed")
        data = encode_record(record)
        written = os.write(self._fd, data)
        if written != len(data):
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes (disk full?)")
        os.fsync(self._fd)

    def rewrite(self, records: Sequence[dict[str, Any]]) -> None:
        """Replaces the file's content with ``records`` atomically (:func:`write_atomically`), keeping the lock."""
        write_atomically(self.path, records)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            _lock(fd, self.path)
        except JobError:
            os.close(fd)
            raise
        self.close()
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        raise JobError(f"output file {str(path)!r} is being written by another running job") from err


def write_atomically(path: str | Path, records: Sequence[dict[str, Any]]) -> None:
    """Replaces ``path`` with ``records`` (:func:`vlmspec.artifacts.write_atomic`): the old or the new file, never
    half."""
    write_atomic(Path(path), lambda tmp: tmp.write_bytes(b"".join(encode_record(r) for r in records)))


def part_path(out: str | Path, rank: int) -> Path:
    """Rank ``rank``'s part file: ``<out>.part<rank>``."""
    out = Path(out)
    return out.with_name(f"{out.name}.part{rank}")


def part_files(out: str | Path) -> list[Path]:
    """The existing part files of ``out``, by rank."""
    out = Path(out)
    found = []
    for file in out.parent.glob(glob.escape(out.name) + ".part*"):
        match = _PART_RE.search(file.name)
        if (
            match and file.name == f"{out.name}.part{int(match.group(1))}"
        ):  # as part_path names it: no "part01"
            found.append((int(match.group(1)), file))
    return [file for _, file in sorted(found)]


def is_success(record: dict[str, Any]) -> bool:
    return "caption" in record


def statuses(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """``id -> "ok" | "error"``; an id with any caption line is ``"ok"``."""
    status: dict[str, str] = {}
    for record in records:
        key = str(record["id"])
        if is_success(record) or key not in status:
            status[key] = "ok" if is_success(record) else "error"
    return status


def merge_records(sources: Sequence[Sequence[dict[str, Any]]], order: Sequence[str]) -> list[dict[str, Any]]:
    """One record per id from several files' records.

    A caption beats an error; otherwise the later record wins (later source, later line). Ids in ``order`` come
    first, in that order; other ids follow in the order first seen.
    """
    best: dict[str, dict[str, Any]] = {}
    for records in sources:
        for record in records:
            key = str(record["id"])
            previous = best.get(key)
            if previous is None or is_success(record) or not is_success(previous):
                best[key] = record
    ordered = [best.pop(key) for key in order if key in best]
    return ordered + list(best.values())


def merge_outputs(out: str | Path, items: Sequence[VideoItem]) -> list[dict[str, Any]]:
    """Merges ``<out>`` and its part files into ``<out>`` (atomically), then removes the part files.

    Returns:
        The merged records (what ``<out>`` now holds).
    """
    out = Path(out)
    parts = part_files(out)
    current = read_output(out, repair=False)
    merged = merge_records([current] + [read_output(p, repair=False) for p in parts], [i.id for i in items])
    if parts or merged != current or scan_output(out).torn:
        write_atomically(out, merged)
    for part in parts:
        part.unlink()
    if parts:
        fsync_dir(out.parent)
    return merged
