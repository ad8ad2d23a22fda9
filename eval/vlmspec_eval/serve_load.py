"""Load on ``vlmspec serve``: many clients at once, the server at several batch sizes and prefix-cache sizes.

    cd eval && python -m vlmspec_eval.serve_load --clients 8 --n 24 --batch-sizes 1,8 --max-tokens 128
    cd eval && python -m vlmspec_eval.serve_load --turns 3 --batch-sizes 8 --prefix-cache-gb 0,1

For each server setting, an in-process :class:`~vlmspec.serving.SpecServer` over the pair (default: the embedded
calibrated pair) answers ``--n`` conversations of ``--turns`` turns, sent by ``--clients`` threads as OpenAI clients
send them: the whole history every turn, streamed so that the time to the first token is seen. A conversation's
first turn is a testbed image caption (a PNG data URI and the task's prompt); the later ones ask about the picture.
Printed per setting: requests (turns) per second, completion tokens/s, median latency and time to the first token
(of all turns, and of the later turns, where a prefix cache gives the history back), the share of prompt tokens the
server took from its prefix cache, and how many replies equal the pipeline's own greedy reply on the same history
(``pipe(messages=...)``, the target's ``generate()``).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vlmspec import PrefixCache, VLMSpecPipeline
from vlmspec.cli import gibibytes, positive_int
from vlmspec.openai_api import MediaAccess, chat_request
from vlmspec.serving import SpecServer
from vlmspec.testbed.world import sample
from vlmspec.testing import make_image

from .flag_types import comma_list

FOLLOW_UPS = ("Which shape is the largest?", "What colour is it?", "Describe the picture again.")


def conversations(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """``n`` first turns: a testbed image caption each, as a streamed chat-completions request."""
    examples = [sample("image_caption", seed) for seed in range(n)]
    return [body(e.image, e.prompt, max_tokens) for e in examples]


def body(image: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
    request = {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens, "stream": True}
    return request | {"stream_options": {"include_usage": True}}


def next_turn(request: dict[str, Any], reply: str, turn: int) -> dict[str, Any]:
    """``request`` with its reply and the next question added (the whole history, as clients send it)."""
    question = FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
    added = [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    return request | {"messages": request["messages"] + added}


@dataclass
class Answer:
    """One streamed reply as the client saw it."""

    text: str
    first_token_s: float
    seconds: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int


def ask(address: tuple[str, int], request: dict[str, Any]) -> Answer:
    """One streamed request, its reply read as it comes."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection(*address, timeout=600)
    connection.request("POST", "/v1/chat/completions", json.dumps(request))
    response = connection.getresponse()
    text, first, usage = "", None, {}
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if piece:
            first = first or time.perf_counter() - start
            text += piece
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    seconds = time.perf_counter() - start
    tokens = usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0)
    return Answer(text, first or 0.0, seconds, *tokens, cached)


def converse(address: tuple[str, int], request: dict[str, Any], turns: int) -> list[Answer]:
    """A conversation of ``turns`` turns, each sending the whole history."""
    answers = []
    for turn in range(turns):
        answers.append(ask(address, request))
        request = next_turn(request, answers[-1].text, turn + 1)
    return answers


def expected_replies(pipe: Any, request: dict[str, Any], turns: int) -> list[str]:
    """The pipeline's own greedy replies to a conversation, turn by turn, each request read as the server reads it."""
    replies = []
    for turn in range(turns):
        call = chat_request({k: v for k, v in request.items() if "stream" not in k}, "", MediaAccess(), 1)
        replies.append(pipe(**call.kwargs).text)
        request = next_turn(request, replies[-1], turn + 1)
    return replies


def run(
    pipe: Any, setting: tuple[int, int], clients: int, firsts: list[dict], turns: int, expected: list
) -> dict:
    """One server setting, ``(batch size, prefix-cache bytes)``, under the whole load: its row."""
    batch_size, cache_bytes = setting
    pipe.prefix_cache = PrefixCache(max_bytes=cache_bytes) if cache_bytes else None
    try:
        with SpecServer(pipe, port=0, batch_size=batch_size) as server:
            url = urlsplit(server.url)
            address = (url.hostname, url.port)
            ask(address, body(make_image(0), "Warm up.", 2))
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda first: converse(address, first, turns), firsts))
            seconds = time.perf_counter() - start
    finally:
        pipe.prefix_cache = None
    answers = [a for conversation in results for a in conversation]
    later = [a for conversation in results for a in conversation[1:]] or answers
    replies = [a.text for a in answers]
    wanted = [text for conversation in expected for text in conversation]
    return {
        "batch": batch_size,
        "prefix cache GiB": cache_bytes / 2**30,
        "requests/s": len(answers) / seconds,
        "completion tokens/s": sum(a.completion_tokens for a in answers) / seconds,
        "latency_s": statistics.median(a.seconds for a in answers),
        "first_token_s": statistics.median(a.first_token_s for a in answers),
        "later turns first_token_s": statistics.median(a.first_token_s for a in later),
        "cached prompt": f"{sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers):.0%}",
        "identical": f"{sum(r == e for r, e in zip(replies, wanted, strict=True))}/{len(answers)}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlmspec_eval.serve_load", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--target", default="testbed-base@cpu", help="pair name or target (default testbed-base@cpu)"
    )
    parser.add_argument("--draft", help="draft, when --target is a model")
    parser.add_argument("--policy", default="sage")
    parser.add_argument("--dtype", default="auto", help="the models' dtype (default auto: the checkpoints')")
    parser.add_argument(
        "--quantization", help="quantize the target as it loads (vlmspec.quantization's names)"
    )
    parser.add_argument("--draft-quantization", help="quantize the draft as it loads (as --quantization)")
    parser.add_argument("--clients", type=positive_int, default=8)
    parser.add_argument("--n", type=positive_int, default=24, help="conversations per setting")
    parser.add_argument("--turns", type=positive_int, default=1, help="turns per conversation (default 1)")
    parser.add_argument(
        "--batch-sizes",
        type=comma_list(positive_int),
        default=(1, 8),
        help="server batch sizes, comma-separated",
    )
    parser.add_argument(
        "--prefix-cache-gb",
        type=comma_list(gibibytes),
        default=(0,),
        help="server prefix-cache sizes in GiB, comma-separated (0: off)",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    args = parser.parse_args(argv)
    pipe = VLMSpecPipeline.from_pretrained(
        args.target,
        args.draft,
        policy=args.policy,
        torch_dtype=args.dtype,
        quantization_config=args.quantization,
        draft_quantization_config=args.draft_quantization,
    )
    firsts = conversations(args.n, args.max_tokens)
    expected = [expected_replies(pipe, first, args.turns) for first in firsts]
    settings = [(size, cache) for size in args.batch_sizes for cache in args.prefix_cache_gb]
    rows = [run(pipe, setting, args.clients, firsts, args.turns, expected) for setting in settings]
    print(f"| {' | '.join(rows[0])} |\n|{' --- |' * len(rows[0])}")
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
