"""What ``vlmspec serve`` has done, in Prometheus' text format (``GET /metrics``).

The speculative-decoding counters are the ones an operator watches to know whether speculation pays on their
traffic: accepted draft tokens per verification step (tau = ``accepted / steps``) and the draft nodes verified for
them (``nodes / steps``), beside the usual request and token counts. Counters only grow; ``in_flight`` is the
requests queued or decoding now.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from .engine import SpecOutput


def _counter(help_text: str, kind: type = int) -> Any:
    """A counter field; ``help_text`` is its ``# HELP`` line on ``/metrics``."""
    return field(default=kind(), metadata={"help": help_text})


@dataclass
class ServerMetrics:
    """Counters of one server since it started (thread-safe: :meth:`count` and :meth:`text` take a lock); each
    field's help text (its metadata) says what it counts. ``requests_ok`` counts draws: a request for ``n``
    sampled choices counts ``n``; ``requests_failed`` counts requests that ended in an error once queued, not
    those refused on arrival (a bad field)."""

    requests_ok: int = _counter("replies decoded (n sampled choices count n)")
    requests_failed: int = _counter("requests that ended in an error once queued")
    prompt_tokens: int = _counter("prompt tokens of the replies (each draw's)")
    cached_prompt_tokens: int = _counter("prompt tokens taken from the prefix cache instead of prefilled")
    generation_tokens: int = _counter("tokens generated")
    verification_steps: int = _counter("target verification forwards after the prefills")
    accepted_draft_tokens: int = _counter("draft tokens accepted (tau = accepted / steps)")
    draft_nodes: int = _counter("draft tokens verified (tree nodes)")
    decode_seconds: float = _counter("seconds decoding, prefills included, summed over requests", float)
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
            self.cached_prompt_tokens += stats.cached_prompt_tokens
            self.generation_tokens += len(result.token_ids)
            self.verification_steps += stats.steps
            self.accepted_draft_tokens += stats.accepted_tokens
            self.draft_nodes += sum(stats.tree_sizes)
            self.decode_seconds += stats.total_seconds

    def text(self, in_flight: int, prefix_cache: Any = None) -> str:
        """The counters, the ``in_flight`` gauge and, with a ``prefix_cache``, its size gauges (entries, bytes) in
        Prometheus' text exposition format."""
        with self._lock:
            counters = [
                (f.name, f.metadata["help"], getattr(self, f.name)) for f in fields(self) if f.metadata
            ]
        lines = []
        for name, help_text, value in counters:
            lines += [f"# HELP vlmspec_{name}_total {help_text}", f"# TYPE vlmspec_{name}_total counter"]
            lines.append(f"vlmspec_{name}_total {value}")
        gauges = [("in_flight", "requests queued or decoding", in_flight)]
        if prefix_cache is not None:
            gauges.append(("prefix_cache_entries", "finished requests' caches kept", len(prefix_cache)))
            gauges.append(("prefix_cache_bytes", "memory those caches take", prefix_cache.nbytes))
        for name, help_text, value in gauges:
            lines += [
                f"# HELP vlmspec_{name} {help_text}",
                f"# TYPE vlmspec_{name} gauge",
                f"vlmspec_{name} {value}",
            ]
        return "\n".join(lines) + "\n"
