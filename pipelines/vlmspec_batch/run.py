"""The batch job's loop: read the requests, skip those answered, decode the rest through a listener-less server,
write each answer as it ends."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmspec_caption.config import JobError
from vlmspec_caption.store import ResultWriter, read_output

from vlmspec.openai_api import APIError, chat_request

PROG = "vlmspec batch"
ENDPOINT = "/v1/chat/completions"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRequest:
    """One line of the input: its ``custom_id`` and its chat-completions ``body``."""

    custom_id: str
    body: Any


def read_requests(path: str | Path) -> list[BatchRequest]:
    """The requests of a batch file, checked line by line.

    Raises:
        JobError: the file cannot be read, or a line is not a request (named with its number and what is wrong).
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(f"input {str(path)!r} cannot be read: {err}") from err
    requests, seen = [], set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"input {str(path)!r} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise JobError(f"{where} is not valid JSON ({err})") from err
        custom_id = row.get("custom_id") if isinstance(row, dict) else None
        if not isinstance(custom_id, str) or not custom_id:
            raise JobError(
                f'{where} needs a "custom_id" string (OpenAI\'s batch format: custom_id, method, url, body)'
            )
        if custom_id in seen:
            raise JobError(f"{where}: custom_id {custom_id!r} is used twice; each request needs its own")
        if row.get("method", "POST") != "POST" or row.get("url", ENDPOINT) != ENDPOINT:
            raise JobError(f'{where}: only "method": "POST" to "url": "{ENDPOINT}" is served')
        seen.add(custom_id)
        requests.append(BatchRequest(custom_id, row.get("body")))
    return requests


def run_batch(server: Any, requests: list[BatchRequest], out: str | Path) -> dict[str, int]:
    """Answer every request of ``requests`` not yet in ``out`` through ``server`` (started, no listener needed),
    ``server.batch_size`` decoding at a time, each answer appended to ``out`` as it ends.

    Returns:
        How many were ``answered`` (200), ``refused`` (an error status) and ``done`` before this run.
    """
    done = {record.get("custom_id") for record in read_output(out, repair=True, prog=PROG)}
    todo = [request for request in requests if request.custom_id not in done]
    totals = {"answered": 0, "refused": 0, "done": len(requests) - len(todo)}
    with ResultWriter(out) as writer, ThreadPoolExecutor(max_workers=server.batch_size) as pool:
        running: set[Future] = set()
        for request in _refill(iter(todo), pool, server, running):
            record = request.result()
            writer.write(record)
            totals["answered" if record["response"]["status_code"] == 200 else "refused"] += 1
    return totals


def _refill(
    todo: Iterator[BatchRequest], pool: ThreadPoolExecutor, server: Any, running: set[Future]
) -> Iterator[Future]:
    """The answers' futures as they end, ``server.batch_size`` requests in flight (the rest read as rows free)."""
    while True:
        while len(running) < server.batch_size and (request := next(todo, None)) is not None:
            running.add(pool.submit(answer, server, request))
        if not running:
            return
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        running -= finished
        yield from finished


def answer(server: Any, request: BatchRequest) -> dict[str, Any]:
    """One output line: the server's reply to ``request``, or its error with its status code."""
    try:
        chat = chat_request(request.body, server.model, server.media, server.max_tokens)
        if chat.stream:
            chat.cleanup()
            raise APIError("stream is not served in a batch: leave it out", "stream")
        status, body = 200, server.complete(chat)
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
