"""Load on ``vlmspec serve``: many clients at once, the server at several batch sizes.

    cd eval && python -m vlmspec_eval.serve_load --clients 8 --n 24 --batch-sizes 1,8 --max-tokens 128

For each server batch size, an in-process :class:`~vlmspec.serving.SpecServer` over the pair (default: the embedded
calibrated pair) answers ``--n`` image-caption requests of the testbed (a PNG data URI and the task's prompt each),
sent by ``--clients`` threads as OpenAI clients send them, streamed so that the time to the first token is seen.
Printed per batch size: requests/s, completion tokens/s, median latency and time to first token, and how many
replies equal the pipeline's own greedy reply (``pipe(messages=...)``, the target's ``generate()``).
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
from typing import Any

from vlmspec import VLMSpecPipeline
from vlmspec.cli import positive_int
from vlmspec.serving import SpecServer
from vlmspec.testbed.world import sample


def requests(n: int) -> list[tuple[Any, str]]:
    """``n`` testbed image captions: (image, prompt)."""
    examples = [sample("image_caption", seed) for seed in range(n)]
    return [(e.image, e.prompt) for e in examples]


def body(image: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
    request = {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens, "stream": True}
    return request | {"stream_options": {"include_usage": True}}


def ask(address: tuple[str, int], request: dict[str, Any]) -> tuple[str, float, float, int]:
    """One streamed request: its text, seconds to the first content chunk, seconds in all, completion tokens."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection(*address, timeout=600)
    connection.request("POST", "/v1/chat/completions", json.dumps(request))
    response = connection.getresponse()
    text, first, tokens = "", None, 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
        piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if piece:
            first = first or time.perf_counter() - start
            text += piece
    return text, first or 0.0, time.perf_counter() - start, tokens


def run(pipe: Any, batch_size: int, clients: int, bodies: list[dict], expected: list[str]) -> dict[str, Any]:
    with SpecServer(pipe, port=0, batch_size=batch_size) as server:
        address = server._http.server_address[:2]
        ask(address, bodies[0])  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(lambda b: ask(address, b), bodies))
        seconds = time.perf_counter() - start
    tokens = sum(r[3] for r in results)
    return {
        "batch": batch_size,
        "requests/s": len(bodies) / seconds,
        "completion tokens/s": tokens / seconds,
        "latency_s": statistics.median(r[2] for r in results),
        "first_token_s": statistics.median(r[1] for r in results),
        "identical": f"{sum(r[0] == e for r, e in zip(results, expected, strict=True))}/{len(bodies)}",
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
    parser.add_argument("--clients", type=positive_int, default=8)
    parser.add_argument("--n", type=positive_int, default=24, help="requests per batch size")
    parser.add_argument("--batch-sizes", default="1,8", help="server batch sizes, comma-separated")
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    args = parser.parse_args(argv)
    sizes = [positive_int(size, "--batch-sizes") for size in args.batch_sizes.split(",")]
    pipe = VLMSpecPipeline.from_pretrained(args.target, args.draft, policy=args.policy)
    examples = requests(args.n)
    bodies = [body(image, prompt, args.max_tokens) for image, prompt in examples]
    expected = [pipe(image, prompt, max_new_tokens=args.max_tokens).text for image, prompt in examples]
    rows = [run(pipe, size, args.clients, bodies, expected) for size in sizes]
    print(f"| {' | '.join(rows[0])} |\n|{' --- |' * len(rows[0])}")
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
