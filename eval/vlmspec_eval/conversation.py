"""Multi-turn conversations: tau, speed-up and prefill time per turn, with the caches kept between turns.

    vlmspec bench --conversation --n 6                       # the calibrated base pair, 6 conversations
    python -m vlmspec_eval.conversation --target testbed-base:qwen2_vl --policies sage,chain --n 6

Each conversation is three turns about one testbed scene: the picture and a caption prompt, a question about the
scene that the picture answers (text only, short reply), then a second picture of the same scene (another
rendering: other noise and jitter) with another caption prompt. The captions are the long replies, so decoding
dominates; the later turns carry the earlier ones (and their picture) as history. Per turn, over all conversations:

* ``generate()``: the target's greedy ``generate()`` on the whole history, prefilled afresh each turn (what a
  transformers user runs); every other method's replies are compared with it token for token;
* ``ar chat``: ``pipe.chat`` without a draft (the caches kept: prefix reuse alone);
* one ``<policy> chat`` per policy: ``pipe.chat`` with that policy;
* the prefill of the same turn through a fresh ``pipe(messages=history)`` (all of the history prefilled) against
  the chat's (only what the earlier turns did not hold), target and draft prefills together.

Every method runs one warm-up conversation first.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .bench import load_pipeline, torch_threads
from .tasks import resolve_pair

TURNS = 3
SYSTEM = "You are a helpful assistant."


@dataclass
class TurnRow:
    """One method's totals for one turn over all conversations."""

    method: str
    turn: int
    seconds: float = 0.0
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    accepted: int = 0
    steps: int = 0
    identical: int = 0
    replies: list[list[int]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.accepted / max(self.steps, 1)


def conversations(n: int, seed: int) -> list[list[tuple[str, Any]]]:
    """``n`` three-turn conversations ``[(text, image or None), ...]`` about testbed scenes."""
    from vlmspec.testbed.world import CAPTION_PROMPTS, render_scene, sample, scene_question

    out = []
    for i in range(n):
        example = sample("image_caption", seed + i)
        rng = random.Random(seed * 7919 + i)
        question, _answer = scene_question(example.scene, rng)
        again = rng.choice([p for p in CAPTION_PROMPTS if p != example.prompt])
        out.append(
            [(example.prompt, example.image), (question, None), (again, render_scene(example.scene, rng))]
        )
    return out


def run_generate(
    pipe: Any, turns: list[tuple[str, Any]], max_new_tokens: int
) -> list[tuple[float, list[int], int]]:
    """``generate()`` on the whole history each turn: (seconds, reply ids, prompt tokens) per turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    results = []
    for text, image in turns:
        content = ([{"type": "image", "image": image}] if image is not None else []) + [
            {"type": "text", "text": text}
        ]
        messages.append({"role": "user", "content": content})
        start = time.perf_counter()
        with pipe.kernels():
            inputs = pipe.prepare_messages(messages)
            ids = pipe.reference_generate(inputs, max_new_tokens)
        results.append((time.perf_counter() - start, ids, inputs["input_ids"].shape[1]))
        reply = pipe.tokenizer.decode(ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return results


def run_chat(pipe: Any, turns: list[tuple[str, Any]], max_new_tokens: int) -> list[tuple[float, Any]]:
    """``pipe.chat`` with the pipeline's policy: (seconds, SpecOutput) per turn."""
    chat = pipe.chat(system=SYSTEM, max_new_tokens=max_new_tokens)
    results = []
    for text, image in turns:
        start = time.perf_counter()
        out = chat.send(text, images=image)
        results.append((time.perf_counter() - start, out))
    return results


def fresh_prefills(pipe: Any, turns: list[tuple[str, Any]], replies: list[Any]) -> list[float]:
    """Prefill seconds (target + draft) of each turn's whole history through a fresh ``pipe(messages=...)``."""
    chat_messages = [{"role": "system", "content": SYSTEM}]
    seconds = []
    for (text, image), reply in zip(turns, replies, strict=True):
        content = ([{"type": "image", "image": image}] if image is not None else []) + [
            {"type": "text", "text": text}
        ]
        chat_messages.append({"role": "user", "content": content})
        stats = pipe(messages=chat_messages, max_new_tokens=1).stats
        seconds.append(stats.prefill_seconds + stats.draft_prefill_seconds)
        chat_messages.append({"role": "assistant", "content": [{"type": "text", "text": reply.text}]})
    return seconds


def measure_conversations(
    pipe: Any,
    convos: list[list[tuple[str, Any]]],
    max_new_tokens: int,
    policies: Sequence[str],
    log: Any = print,
) -> tuple[list[TurnRow], list[float], list[float]]:
    """Rows per method and turn, and per turn the fresh and chat prefill seconds of the first policy's chats."""
    from vlmspec import get_policy

    rows: dict[tuple[str, int], TurnRow] = {}
    run_generate(pipe, convos[0], 4)  # warm-up
    reference = []
    for convo in convos:
        results = run_generate(pipe, convo, max_new_tokens)
        reference.append([ids for _, ids, _ in results])
        for turn, (seconds, ids, prompt_tokens) in enumerate(results):
            row = rows.setdefault(("generate()", turn), TurnRow("generate()", turn))
            row.seconds += seconds
            row.prompt_tokens += prompt_tokens
            row.new_tokens += len(ids)
            row.identical += 1
    log(f"generate(): {sum(r.seconds for r in rows.values()):.1f} s")
    fresh, cached = [0.0] * TURNS, [0.0] * TURNS
    for index, policy in enumerate(["ar", *policies]):
        pipe.policy = get_policy(policy)
        run_chat(pipe, convos[0], 4)  # warm-up
        method = f"{policy} chat"
        for convo, expected in zip(convos, reference, strict=True):
            results = run_chat(pipe, convo, max_new_tokens)
            for turn, (seconds, out) in enumerate(results):
                row = rows.setdefault((method, turn), TurnRow(method, turn))
                stats = out.stats
                row.seconds += seconds
                row.new_tokens += len(out.token_ids)
                row.prompt_tokens += stats.prompt_tokens
                row.cached_tokens += stats.cached_prompt_tokens
                row.prefill_seconds += stats.prefill_seconds + stats.draft_prefill_seconds
                row.accepted += stats.accepted_tokens
                row.steps += stats.steps
                row.identical += out.token_ids == expected[turn]
            if index == 1:  # the prefill comparison, with the first speculative policy's draft
                for turn, seconds in enumerate(fresh_prefills(pipe, convo, [o for _, o in results])):
                    fresh[turn] += seconds
                    cached[turn] += results[turn][1].stats.prefill_seconds
                    cached[turn] += results[turn][1].stats.draft_prefill_seconds
        log(f"{method}: {sum(r.seconds for k, r in rows.items() if k[0] == method):.1f} s")
    return list(rows.values()), fresh, cached


def markdown(rows: Sequence[TurnRow], fresh: Sequence[float], cached: Sequence[float], n: int) -> str:
    """Per turn: one line per method; speed-ups over ``generate()`` and over ``ar chat`` (same turn)."""
    by = {(r.method, r.turn): r for r in rows}
    lines = [
        "| turn | method | prompt tokens | cached | reply tokens | s/conversation | x generate() | x ar chat | tau "
        "| identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: r.turn):
        generate, ar = by[("generate()", r.turn)], by.get(("ar chat", r.turn))
        chat = r.method != "generate()"
        lines.append(
            f"| {r.turn + 1} | {r.method} | {r.prompt_tokens / n:.0f} | {r.cached_tokens / n:.0f} | "
            f"{r.new_tokens / n:.0f} | {r.seconds / n:.2f} | {generate.seconds / r.seconds:.2f}x | "
            f"{f'{ar.seconds / r.seconds:.2f}x' if chat and ar else ''} | {f'{r.tau:.2f}' if chat else ''} | "
            f"{r.identical}/{n} |"
        )
    lines += [
        "",
        "| turn | prefill, fresh call (s) | prefill, chat (s) | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for turn, (a, b) in enumerate(zip(fresh, cached, strict=True)):
        lines.append(f"| {turn + 1} | {a / n:.3f} | {b / n:.3f} | {a / max(b, 1e-9):.1f}x |")
    return "\n".join(lines)


def run_section(config: Any, policies: Sequence[str]) -> int:
    """``vlmspec bench --conversation``: the bench's pair (``config``: a ``BenchConfig``), ``config.n``
    conversations; prints the tables and writes them to ``<out>/conversation.md``."""
    with torch_threads(config.threads):
        pair = resolve_pair(config.target, config.draft, config.family, config.size, config.calibration)
        pipe = load_pipeline(pair, config.dtype)
        table = _run(pipe, pair.source, config.n, config.seed, config.max_new_tokens, policies)
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / "conversation.md"
    path.write_text(table + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _run(pipe: Any, source: str, n: int, seed: int, max_new_tokens: int, policies: Sequence[str]) -> str:
    head = f"pair {source}; {n} conversations of {TURNS} turns; up to {max_new_tokens} new tokens per reply"
    print(head, flush=True)
    convos = conversations(n, seed)
    rows, fresh, cached = measure_conversations(
        pipe, convos, max_new_tokens, policies, log=lambda line: print(line, flush=True)
    )
    table = f"{head}\n\n{markdown(rows, fresh, cached, n)}"
    print(table)
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlmspec_eval.conversation", description=__doc__.split("\n\n")[0]
    )
    a = parser.add_argument
    a("--target", default=None, help="pair name or target folder (default: the calibrated base pair)")
    a("--draft", default=None, help="draft folder (with a target folder)")
    a("--family", default="qwen2_vl", help="testbed family when no --target is given")
    a("--policies", default="sage", help="speculative policies, comma-separated (default sage)")
    a("--dtype", default="float32", help="model dtype")
    a("--n", type=int, default=6, help="conversations (default 6)")
    a("--max-new-tokens", type=int, default=128)
    a("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    pair = resolve_pair(args.target, args.draft, args.family)
    pipe = load_pipeline(pair, args.dtype)
    _run(pipe, pair.source, args.n, args.seed, args.max_new_tokens, policies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
