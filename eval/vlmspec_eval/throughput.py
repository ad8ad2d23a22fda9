"""Throughput: captioning many videos at batch B, vlmspec against transformers' own batched ``generate()``.

    vlmspec bench --throughput 1,4,8,16 --n 24 --max-new-tokens 128   # the calibrated base pair, 24 videos
    vlmspec bench --throughput 8,32 --n 32 --throughput-policies sage,edd+chain   # the pair's EDD draft beside it
    vlmspec bench --throughput 1,8,16 --target testbed-base:qwen2_vl@7b-2b --dtype bfloat16   # a GPU-shaped pair

For each batch size ``B``: ``hf_generate`` runs the target's greedy ``generate()`` on left-padded batches of ``B``
videos (what a user without vlmspec runs; a batch waits for its longest caption), and ``vlmspec`` runs
``pipe.batch(requests, batch_size=B)`` with each ``--throughput-policies`` policy (``edd+<policy>``: with the EDD
draft shipped for a testbed pair, or ``--edd FOLDER``'s, in place of the pair's own draft), its node budget and depth
refitted for ``B`` requests per verification (continuous batching: a finished caption's row goes to the next
video at once). ``vlmspec`` at batch 1 is the same call with ``B = 1``. Every run is warmed up on ``B`` videos
first; captions are compared with batch-1 ``generate()``'s token for token. Printed: videos/s, new tokens/s,
speed-up over ``hf_generate`` at the same ``B``, tau and how many captions are identical.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.inputs import on_device
from vlmspec.stopping import eos_token_ids, until_eos

from .bench import progress_log, torch_threads
from .methods import EDD_PREFIX
from .report import table, write_section
from .tasks import load_config_pair, load_inputs, pair_heading, section_edd_pipeline


@dataclass
class ThroughputRow:
    method: str
    batch_size: int
    seconds: float
    videos: int
    new_tokens: int
    identical: int
    tau: float | None = None

    @property
    def videos_per_s(self) -> float:
        return self.videos / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds


def batched_generate(pipe: Any, requests: Sequence[dict[str, Any]], max_new_tokens: int) -> list[list[int]]:
    """Greedy ``target.generate`` on one left-padded batch of video requests; each row up to its first EOS."""
    from vlmspec.inputs import load_video

    processor, tokenizer = pipe.processor, pipe.tokenizer
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": r["prompt"]}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for r in requests
    ]
    videos = [load_video(r["video"]) for r in requests]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        inputs = processor(
            text=texts, videos=[frames for frames, _ in videos], video_metadata=[meta for _, meta in videos],
            do_sample_frames=False, padding=True, return_tensors="pt",
        )  # fmt: skip
    finally:
        tokenizer.padding_side = side
    inputs = on_device(inputs, pipe.target.device)
    with torch.inference_mode():
        out = pipe.target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    eos = eos_token_ids(pipe.target)
    return [until_eos(row, eos) for row in out[:, inputs["input_ids"].shape[1] :].tolist()]


def measure_throughput(
    pipe: Any,
    requests: Sequence[dict[str, Any]],
    sizes: Sequence[int],
    policies: Sequence[str] = ("sage",),
    log: Any = print,
    edd_pipe: Any = None,
) -> list[ThroughputRow]:
    """``hf_generate`` and one ``vlmspec`` row per policy for every batch size (see the module docstring);
    ``edd+<policy>`` rows run on ``edd_pipe`` (the same target with an EDD draft)."""
    from vlmspec import get_policy

    max_new = requests[0]["max_new_tokens"]
    reference = [
        pipe.reference_generate(pipe.prepare_inputs(None, r["prompt"], r["video"]), max_new) for r in requests
    ]
    rows = []
    for size in sizes:
        with pipe.kernels():
            # warm-up as long as the run, like vlmspec's below: a 4-token warm-up left the first timed run of
            # batch 32 at 5.15 videos/s against 5.9-6.0 on repeats (memory the longer run grows into is new)
            batched_generate(pipe, requests[:size], max_new)
            start = time.perf_counter()
            ids = [
                t
                for i in range(0, len(requests), size)
                for t in batched_generate(pipe, requests[i : i + size], max_new)
            ]
            seconds = time.perf_counter() - start
        rows.append(_row("hf_generate", size, seconds, ids, reference))
        log(_line(rows[-1]))
        for policy in policies:
            chosen = edd_pipe if policy.startswith(EDD_PREFIX) else pipe
            chosen.policy = get_policy(policy.removeprefix(EDD_PREFIX))
            chosen.batch(requests[:size], batch_size=size)  # warm-up
            start = time.perf_counter()
            outs = chosen.batch(requests, batch_size=size)
            seconds = time.perf_counter() - start
            tau = sum(o.stats.accepted_tokens for o in outs) / max(sum(o.stats.steps for o in outs), 1)
            ids = [o.token_ids for o in outs]
            rows.append(_row(f"vlmspec {policy}", size, seconds, ids, reference, tau))
            log(_line(rows[-1]))
    return rows


def _row(method: str, size: int, seconds: float, ids: list[list[int]], reference: list[list[int]], tau=None):
    same = sum(a == b for a, b in zip(ids, reference, strict=True))
    return ThroughputRow(method, size, seconds, len(ids), sum(map(len, ids)), same, tau)


def _line(row: ThroughputRow) -> str:
    return f"{row.method} B={row.batch_size}: {row.videos_per_s:.2f} videos/s, {row.tokens_per_s:.0f} tok/s"


def markdown(rows: Sequence[ThroughputRow]) -> str:
    """The throughput table; speed-ups are over ``hf_generate`` at the same batch size."""
    hf = {r.batch_size: r for r in rows if r.method == "hf_generate"}
    lines = []
    for r in rows:
        base = hf.get(r.batch_size)
        ratio = f"{r.videos_per_s / base.videos_per_s:.2f}x" if base is not None else ""
        tau = "" if r.tau is None else f"{r.tau:.2f}"
        lines.append([r.method, str(r.batch_size), f"{r.videos_per_s:.2f}", f"{r.tokens_per_s:.0f}", ratio, tau,
                      f"{r.identical}/{r.videos}"])  # fmt: skip
    header = ["method", "batch", "videos/s", "new tokens/s", "x hf_generate (same batch)", "tau", "identical"]
    return table(header, lines)


def video_requests(n: int, seed: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """``n`` testbed video-captioning requests."""
    items = load_inputs(["video_caption"], n, seed)
    return [{"video": it.video, "prompt": it.prompt, "max_new_tokens": max_new_tokens} for it in items]


def run_section(config: Any, sizes: Sequence[int], policies: Sequence[str]) -> int:
    """``vlmspec bench --throughput SIZES``: the bench's pair (``config``: a ``BenchConfig``), ``config.n`` videos;
    prints the table and writes it to ``<out>/throughput.md``."""
    with torch_threads(config.threads):
        pair, pipe = load_config_pair(config)
        edd_pipe = section_edd_pipeline(pipe, pair, config, policies)
        requests = video_requests(config.n, config.seed, config.max_new_tokens)
        print(
            f"pair {pair_heading(pair, config)}; {config.n} videos; {config.max_new_tokens} tokens",
            flush=True,
        )
        rows = measure_throughput(
            pipe, requests, sizes, policies, log=progress_log(config.verbose), edd_pipe=edd_pipe
        )
    text = markdown(rows)
    print(text)
    head = f"pair {pair_heading(pair, config)}; {config.n} videos; {config.max_new_tokens} new tokens"
    return write_section(config.out, "throughput.md", f"{head}\n\n{text}")
