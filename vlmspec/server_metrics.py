"""What ``vlmspec serve`` has done, in Prometheus' text format (``GET /metrics``).

The speculative-decoding counters are the ones an operator watches to know whether speculation pays on their
traffic: accepted draft tokens per verification step (tau = ``accepted / steps``) and the draft nodes verified for
them (``nodes / steps``), beside the usual request and token counts. Counters only grow; ``in_flight`` is the
requests queued or decoding now.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from .engine import SpecOutput


@dataclass
class ServerMetrics:
    """Counters of one server since it started (thread-safe: :meth:`count` and :meth:`text` take a lock).

    Attributes:
        requests_ok: replies decoded (a request for ``n`` sampled choices counts ``n``: each is a draw).
        requests_failed: requests that ended in an error once queued (media that would not load, a client that
            left, a failed batch); requests refused on arrival (a bad field) are not counted.
        prompt_tokens: prompt tokens of the replies (each draw's).
        generation_tokens: tokens generated for the replies.
        verification_steps: target verification forwards after the prefills.
        accepted_draft_tokens: draft tokens the target accepted.
        draft_nodes: draft tokens (tree nodes) the target verified.
        decode_seconds: seconds the replies took, prefills included (summed over requests).
    """

    requests_ok: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    verification_steps: int = 0
    accepted_draft_tokens: int = 0
    draft_nodes: int = 0
    decode_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, result: SpecOutput | BaseException) -> None:
        """Add one request's ``result`` (its output, or the exception it ended with)."""
        with self._lock:
            if isinstance(result, BaseException):
                self.requests_failed += 1
                return
            stats = result.stats
            self.requests_ok += 1
            self.prompt_tokens += stats.prompt_tokens
            self.generation_tokens += len(result.token_ids)
            self.verification_steps += stats.steps
            self.accepted_draft_tokens += stats.accepted_tokens
            self.draft_nodes += sum(stats.tree_sizes)
            self.decode_seconds += stats.total_seconds

    def text(self, in_flight: int) -> str:
        """The counters (and the ``in_flight`` gauge) in Prometheus' text exposition format."""
        with self._lock:
            values = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        lines = []
        for name, value in values.items():
            doc = _DOCS[name]
            lines += [f"# HELP vlmspec_{name}_total {doc}", f"# TYPE vlmspec_{name}_total counter"]
            lines.append(f"vlmspec_{name}_total {value}")
        lines += ["# HELP vlmspec_in_flight requests queued or decoding", "# TYPE vlmspec_in_flight gauge"]
        lines.append(f"vlmspec_in_flight {in_flight}")
        return "\n".join(lines) + "\n"


_DOCS = {
    "requests_ok": "replies decoded (n sampled choices count n)",
    "requests_failed": "requests that ended in an error once queued",
    "prompt_tokens": "prompt tokens of the replies",
    "generation_tokens": "tokens generated",
    "verification_steps": "target verification forwards",
    "accepted_draft_tokens": "draft tokens accepted (tau = accepted / steps)",
    "draft_nodes": "draft tokens verified (tree nodes)",
    "decode_seconds": "seconds decoding, prefills included, summed over requests",
}
