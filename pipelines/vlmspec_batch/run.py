"""The batch job's loop: read the requests, skip those answered, decode the rest through a listener-less server,
write each answer as it ends."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmspec_caption.config import JobError, json_object
from vlmspec_caption.store import ResultWriter, read_output

from vlmspec.openai_api import APIError

PROG = "vlmspec batch"
ENDPOINT = "/v1/chat/completions"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRequest:
    """One line of the input: its ``custom_id`` and its chat-completions ``body``."""

    custom_id: str
    body: Any


@dataclass(frozen=True)
class BatchFile:
    """A batch input file whose every line was checked (:func:`read_requests`): its requests' ``ids`` in order, and
    the requests read again one line at a time (:meth:`requests`), so that a file of any size is never held whole."""

    path: Path
    ids: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.ids)

    def requests(self, skip: Collection[str] = ()) -> Iterator[BatchRequest]:
        """The file's requests in order, but those whose ``custom_id`` is in ``skip``."""
        for _, row in _rows(self.path):
            if row["custom_id"] not in skip:
                yield BatchRequest(row["custom_id"], row.get("body"))


def read_requests(path: str | Path) -> BatchFile:
    """The requests of a batch file, checked line by line as it is read (only their ids are kept).

    Raises:
        JobError: the file cannot be read, or a line is not a request (named with its number and what is wrong).
    """
    ids: dict[str, None] = {}
    for number, row in _rows(Path(path)):
        where = f"input {str(path)!r} line {number}"
        custom_id = row.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise JobError(
                f'{where} needs a "custom_id" string (OpenAI\'s batch format: custom_id, method, url, body)'
            )
        if custom_id in ids:
            raise JobError(f"{where}: custom_id {custom_id!r} is used twice; each request needs its own")
        if row.get("method", "POST") != "POST" or row.get("url", ENDPOINT) != ENDPOINT:
            raise JobError(f'{where}: only "method": "POST" to "url": "{ENDPOINT}" is served')
        ids[custom_id] = None
    return BatchFile(Path(path), tuple(ids))


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each non-blank line of ``path`` as ``(line number, JSON object)``, read one at a time.

    Raises:
        JobError: the file cannot be read, or a line is not a JSON object (named with its number).
    """
    try:
        with path.open(encoding="utf-8-sig") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, json_object(line, f"input {str(path)!r} line {number}")
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(f"input {str(path)!r} cannot be read: {err}") from err


def is_batch_record(record: dict[str, Any]) -> bool:
    """A line of this job: a request's ``response`` under its ``custom_id``."""
    return "custom_id" in record and "response" in record


def answered(batch: BatchFile, writer: ResultWriter) -> tuple[set[str], int]:
    """The ids of ``batch`` that ``writer``'s file (locked: this process owns it) answers already, and how many of
    its answers are refusals. An answer that was the server's failure (status 500 and above: out of memory, a
    shutdown) is taken out of the file so that its request runs again; a refusal (4xx) is the request's own and
    stays."""
    records = read_output(writer.path, repair=True, prog=PROG, ours=is_batch_record)
    kept = [record for record in records if record["response"].get("status_code", 500) < 500]
    if len(kept) < len(records):
        writer.rewrite(kept)
    refused = sum(record["response"]["status_code"] != 200 for record in kept)
    return {record["custom_id"] for record in kept}.intersection(batch.ids), refused


def run_batch(server: Any, todo: Iterable[BatchRequest], writer: ResultWriter) -> dict[str, int]:
    """Answer ``todo`` through ``server`` (started; no listener needed), ``server.batch_size`` decoding at a time,
    each answer appended to ``writer`` as it ends. An exception (Ctrl-C) ends the requests decoding at their next
    step, and is raised once they have (their answers are not written: a rerun gives them).

    Returns:
        How many were ``answered`` (200) and ``refused`` (an error status).
    """
    totals, stop = {"answered": 0, "refused": 0}, threading.Event()
    with ThreadPoolExecutor(max_workers=server.batch_size) as pool:
        try:
            for future in _refill(iter(todo), pool, server, stop, set()):
                if (record := future.result()) is not None:
                    writer.write(record)
                    totals["answered" if record["response"]["status_code"] == 200 else "refused"] += 1
        except BaseException:
            stop.set()  # each worker's request ends at its next step, so the pool's shutdown does not wait long
            raise
    return totals


def _refill(
    todo: Iterator[BatchRequest],
    pool: ThreadPoolExecutor,
    server: Any,
    stop: threading.Event,
    running: set[Future],
) -> Iterator[Future]:
    """The answers' futures as they end, ``server.batch_size`` requests in flight (the rest read as rows free)."""
    while True:
        while len(running) < server.batch_size and (request := next(todo, None)) is not None:
            running.add(pool.submit(answer, server, request, stop))
        if not running:
            return
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        running -= finished
        yield from finished


def answer(server: Any, request: BatchRequest, stop: threading.Event) -> dict[str, Any] | None:
    """One output line: the server's reply to ``request``, or its error with its status code (``None`` once
    ``stop`` is set: the request ended unanswered)."""
    try:
        chat = server.chat_request(request.body)
        if chat.stream:
            chat.cleanup()
            raise APIError("stream is not served in a batch: leave it out", "stream")
        status, body = 200, server.complete(chat, gone=stop.is_set)
        if body is None:
            return None
    except APIError as error:
        status, body = error.status, error.body()
    except Exception as error:  # the server's fault, not the request's: answered as the server answers it
        logger.exception("request %s failed", request.custom_id)
        failure = APIError(f"the server failed on this request: {type(error).__name__}: {error}", status=500)
        status, body = failure.status, failure.body()
    response = {"status_code": status, "request_id": f"vlmspec-{uuid.uuid4().hex}", "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": request.custom_id,
        "response": response,
        "error": None,
    }
