"""A file of OpenAI batch requests decoded by a pipeline: ``vlmspec batch`` (vLLM's ``run-batch``).

Usage (``vlmspec batch`` and ``python -m vlmspec_batch`` take the same arguments)::

    vlmspec batch requests.jsonl --out results.jsonl --target T --draft D --batch-size 8

Input: JSONL, one request per line as OpenAI's Batch API takes them::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "vlmspec", "messages": [...], "max_completion_tokens": 256}}

Each ``body`` is a chat-completions request, read as ``vlmspec serve`` reads one (images, videos, structured
outputs, tools, sampling, ``n``, logprobs; not ``stream``): every reply is what the server would answer, which is
what ``pipe(messages=...)`` gives. ``custom_id`` is unique in the file; a line without one, or not a JSON object, is
an error before any decoding. The file is read one line at a time, twice (checked, then decoded): only the
requests' ids are held, whatever its size.

Output: JSONL, one line per request, as OpenAI's batch output gives them::

    {"id": "batch_req_...", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "...", "body": {"object": "chat.completion", ...}}, "error": null}

A request the server would refuse gets its status code and OpenAI's error body in ``response`` (a 400 naming the
field, a 404 for another model's name: ``--served-model-name`` sets the name the file's requests use), and the job
goes on. The requests decode ``--batch-size`` at a time through one :class:`~vlmspec.serving.SpecServer` without a
listener (continuous batching: a finished request's row goes to the next at once), lines written whole and fsynced
as requests end, in the order they end. The output file is locked first (one job per file; another job's file is
refused, unchanged), and the pair loads only when something is left to answer. A killed job rerun with the same
command skips the ``custom_id`` s already answered (a torn last line repaired; :mod:`vlmspec_caption.store` keeps
the file); an answer that was the server's failure (5xx) is dropped and its request runs again. Ctrl-C ends the
requests decoding at their next step. Exit code 0 every answer in the file is a 200, 2 some are refusals, 1 the job
could not run, 130 interrupted (rerun to resume).
"""

from .run import BatchFile, BatchRequest, answered, read_requests, run_batch

__all__ = ["BatchFile", "BatchRequest", "answered", "read_requests", "run_batch"]
