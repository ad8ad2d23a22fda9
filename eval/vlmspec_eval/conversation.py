"""Multi-turn conversations: tau, speed-up and prefill time per turn, with the caches kept between turns.

    vlmspec bench --conversation --n 6                       # the calibrated base pair, 6 conversations
    vlmspec bench --conversation --target testbed-base:qwen2_vl --throughput-policies sage,chain --n 6
    vlmspec bench --conversation --throughput-policies chain,edd+chain --n 6   # the pair's EDD draft beside it

Each conversation is three turns about one testbed scene: the picture and a caption prompt, a question about the
scene that the picture answers (text only, short reply), then a second picture of the same scene (another
rendering: other noise and jitter) with another caption prompt. The captions are the long replies, so decoding
dominates; the later turns carry the earlier ones (and their picture) as history. Per turn, over all conversations:

* ``generate()``: the target's greedy ``generate()`` on the whole history, prefilled afresh each turn (what a
  transformers user runs); every other method's replies are compared with it token for token;
* ``ar chat``: ``pipe.chat`` without a draft (the caches kept: prefix reuse alone);
* one ``<policy> chat`` per policy: ``pipe.chat`` with that policy (``edd+<policy>``: with the EDD draft shipped
  for a testbed pair, or ``--edd FOLDER``'s, in place of the pair's own draft);
* the prefill of the same turn through a fresh ``pipe(messages=history)`` (all of the history prefilled) against
  the chat's (only what the earlier turns did not hold), target and draft prefills together.

Every method runs one warm-up conversation first; then the methods take turns, conversation by conversation.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.chat import system_turn

from .bench import progress_log, torch_threads
from .methods import EDD_PREFIX
from .report import table, write_section
from .tasks import load_config_pair, pair_heading, section_edd_pipeline

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
    accepted: int = 0
    steps: int = 0
    identical: int = 0

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
    messages = [system_turn(SYSTEM)]
    results = []
    for text, image in turns:
        messages.append(user_message(text, image))
        start = time.perf_counter()
        with pipe.kernels():
            inputs = pipe.prepare_messages(messages)
            ids = pipe.reference_generate(inputs, max_new_tokens)
        results.append((time.perf_counter() - start, ids, inputs["input_ids"].shape[1]))
        reply = pipe.tokenizer.decode(ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return results


def user_message(text: str, image: Any) -> dict[str, Any]:
    """A user turn in transformers' chat format: the image (if any), then the text."""
    content = [{"type": "image", "image": image}] if image is not None else []
    return {"role": "user", "content": [*content, {"type": "text", "text": text}]}


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
    chat_messages = [system_turn(SYSTEM)]
    seconds = []
    for (text, image), reply in zip(turns, replies, strict=True):
        chat_messages.append(user_message(text, image))
        stats = pipe(messages=chat_messages, max_new_tokens=1).stats
        seconds.append(stats.prefill_seconds + stats.draft_prefill_seconds)
        chat_messages.append({"role": "assistant", "content": [{"type": "text", "text": reply.text}]})
    return seconds


@torch.inference_mode()
def measure_conversations(
    pipe: Any,
    convos: list[list[tuple[str, Any]]],
    max_new_tokens: int,
    policies: Sequence[str],
    log: Any = print,
    edd_pipe: Any = None,
) -> tuple[list[TurnRow], list[float], list[float]]:
    """Rows per method and turn, and per turn the fresh and chat prefill seconds of the first policy's chats.

    ``edd+<policy>`` chats run on ``edd_pipe`` (the same target with an EDD draft). Methods are interleaved
    conversation by conversation, so that machine noise falls on all of them alike.
    """
    from vlmspec import get_policy

    def with_policy(method: str) -> Any:
        chosen = edd_pipe if method.startswith(EDD_PREFIX) else pipe
        chosen.policy = get_policy(method.removeprefix(EDD_PREFIX))
        return chosen

    chats = ["ar", *policies]
    run_generate(pipe, convos[0], 4)  # warm-ups
    for policy in chats:
        run_chat(with_policy(policy), convos[0], 4)
    rows: dict[tuple[str, int], TurnRow] = {}
    fresh, cached = [0.0] * TURNS, [0.0] * TURNS
    for number, convo in enumerate(convos):
        reference = run_generate(pipe, convo, max_new_tokens)
        for turn, (seconds, ids, prompt_tokens) in enumerate(reference):
            _add(rows, "generate()", turn, seconds, ids, ids, prompt_tokens)
        for policy in chats:
            chat_pipe = with_policy(policy)
            results = run_chat(chat_pipe, convo, max_new_tokens)
            for turn, (seconds, out) in enumerate(results):
                row = _add(rows, f"{policy} chat", turn, seconds, out.token_ids, reference[turn][1])
                _add_stats(row, out.stats)
            if (
                policy == chats[min(1, len(chats) - 1)]
            ):  # the prefills, with the first speculative policy's draft
                for turn, seconds in enumerate(fresh_prefills(chat_pipe, convo, [o for _, o in results])):
                    fresh[turn] += seconds
                    cached[turn] += results[turn][1].stats.prefill_seconds
                    cached[turn] += results[turn][1].stats.draft_prefill_seconds
        log(f"conversation {number + 1}/{len(convos)} done")
    return list(rows.values()), fresh, cached


def _add(
    rows: dict[tuple[str, int], TurnRow],
    method: str,
    turn: int,
    seconds: float,
    ids: list[int],
    expected: list[int],
    prompt_tokens: int = 0,
) -> TurnRow:
    row = rows.setdefault((method, turn), TurnRow(method, turn))
    row.seconds += seconds
    row.new_tokens += len(ids)
    row.prompt_tokens += prompt_tokens
    row.identical += ids == expected
    return row


def _add_stats(row: TurnRow, stats: Any) -> None:
    row.prompt_tokens += stats.prompt_tokens
    row.cached_tokens += stats.cached_prompt_tokens
    row.accepted += stats.accepted_tokens
    row.steps += stats.steps


def markdown(rows: Sequence[TurnRow], fresh: Sequence[float], cached: Sequence[float], n: int) -> str:
    """Per turn: one line per method; speed-ups over ``generate()`` and over ``ar chat`` (same turn)."""
    by = {(r.method, r.turn): r for r in rows}
    lines = []
    for r in sorted(rows, key=lambda r: r.turn):
        generate, ar = by[("generate()", r.turn)], by.get(("ar chat", r.turn))
        chat = r.method != "generate()"
        lines.append(
            [str(r.turn + 1), r.method, f"{r.prompt_tokens / n:.0f}", f"{r.cached_tokens / n:.0f}",
             f"{r.new_tokens / n:.0f}", f"{r.seconds / n:.2f}", f"{generate.seconds / r.seconds:.2f}x",
             f"{ar.seconds / r.seconds:.2f}x" if chat and ar else "", f"{r.tau:.2f}" if chat else "",
             f"{r.identical}/{n}"]
        )  # fmt: skip
    header = ["turn", "method", "prompt tokens", "cached", "reply tokens", "s/conversation", "x generate()",
              "x ar chat", "tau", "identical"]  # fmt: skip
    prefills = [
        [str(turn + 1), f"{a / n:.3f}", f"{b / n:.3f}", f"{a / max(b, 1e-9):.1f}x"]
        for turn, (a, b) in enumerate(zip(fresh, cached, strict=True))
    ]
    prefill_header = ["turn", "prefill, fresh call (s)", "prefill, chat (s)", "ratio"]
    return table(header, lines) + "\n\n" + table(prefill_header, prefills)


def run_section(config: Any, policies: Sequence[str]) -> int:
    """``vlmspec bench --conversation``: the bench's pair (``config``: a ``BenchConfig``), ``config.n``
    conversations; prints the tables and writes them to ``<out>/conversation.md``."""
    with torch_threads(config.threads):
        pair, pipe = load_config_pair(config)
        head = (
            f"pair {pair_heading(pair, config)}; {config.n} conversations of {TURNS} turns; up to "
            f"{config.max_new_tokens} new tokens per reply"
        )
        print(head, flush=True)
        edd_pipe = section_edd_pipeline(pipe, pair, config, policies)
        convos = conversations(config.n, config.seed)
        rows, fresh, cached = measure_conversations(
            pipe, convos, config.max_new_tokens, policies, log=progress_log(config.verbose), edd_pipe=edd_pipe
        )
    text = markdown(rows, fresh, cached, config.n)
    print(text)  # the header went out first, as the section started
    return write_section(config.out, "conversation.md", f"{head}\n\n{text}")
