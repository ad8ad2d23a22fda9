"""The bench's sampling sections: lossless policies at temperature 1, and DSBD against the target's beam sampling.

``--sampling``: ``ar`` and every lossless tree policy of ``--methods`` (``hf_generate`` and ``hf_assisted`` excluded:
they are transformers' greedy paths; ``dsbd`` too: it is not lossless) decode with ``do_sample=True`` at
temperature 1, ``top_k``/``top_p`` left to the target's ``generation_config`` (so the output follows the target's
own sampling distribution whatever the tree). Run ``repeat`` of every input uses seed ``seed + repeat``; the
methods run interleaved like the greedy section (order rotated per repeat). Per method and task (and ``all``
tasks pooled when there are several), over inputs x repeats:

* ``tau`` (``stats.mean_accepted``) and ``tokens_per_step``: medians over the runs that made a verification step
  (a reply that ends with the prefill's token has none);
* ``tokens_per_s``: median;
* ``speedup``: median of each run's tokens/s over ``ar``'s in the same input and repeat (interleaved, so a slow
  moment of the machine hits both).

``--dsbd``: on the ``image_qa`` inputs (the testbed's, with short exact references), three rows, each at the
warping of DSBD's config (paper section 4: temperature 1, top-k 10, top-p 0.8) and seeds ``seed + repeat``:

* ``dsbd``: the engine with policy ``dsbd`` (memory mode, dynamic width, see :mod:`vlmspec.policies.dsbd`);
* ``beam_sampling``: the target's ``generate(num_beams=W, do_sample=True)``, ``W`` from ``--beam-width`` or, by
  default, dsbd's output width: the rounded mean number of output beams per drafted step over a warm-up run of
  dsbd on every input;
* ``multinomial``: the same with ``num_beams=1`` (plain sampling).

Reported: tokens/s (median over inputs x repeats), speed-up over beam sampling (median of paired ratios),
perplexity of the output under the target (raw distribution, mean over runs), exact match (the reply stripped
equals the reference; mean over runs with a reference, ``None`` without), the width (dsbd: mean output beams per
drafted step) and dsbd's tau (median over runs with a verification step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vlmspec.policies import TreePolicy, get_policy
from vlmspec.policies.dsbd import PAPER_TOP_K, PAPER_TOP_P
from vlmspec.sampling import SamplingParams

from .dsbd_baseline import beam_sampling_baseline, perplexity
from .methods import AR, TRANSFORMERS_METHODS, Variant, build_variants, generate_with, interleaved
from .report import mean_or_none, median_or_none, ratio_median
from .tasks import TaskInput, load_inputs

TEMPERATURE = 1.0
DSBD = "dsbd"
BEAM_SAMPLING = "beam_sampling"
MULTINOMIAL = "multinomial"
DSBD_METHODS: tuple[str, ...] = (DSBD, BEAM_SAMPLING, MULTINOMIAL)
QA_TASK = "image_qa"
ALL_TASKS = "all"
BASELINE_ERRORS = (RuntimeError, ValueError, TypeError)
"""What transformers' beam sampling may raise for a family without stopping the bench (the row reports it)."""

Logger = Callable[[str], None]


@dataclass
class SampleRun:
    """One timed sampled generation of ``key`` (``ar``, a policy, ``beam_sampling`` or ``multinomial``) on an input,
    with seed ``seed + repeat``. ``steps``, ``tau``, ``tokens_per_step``, ``lossless``: the engine's stats (empty for
    the ``generate()`` baselines); ``widths``: output beams per drafted step (dsbd) or ``[W]`` (the baselines);
    ``perplexity`` and ``exact_match``: the DSBD section's scores; ``error``: why the run failed, else ``None``.
    """

    key: str
    task: str
    index: int
    repeat: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    total_s: float = 0.0
    steps: int = 0
    tau: float = 0.0
    tokens_per_step: float = 0.0
    lossless: bool | None = None
    widths: list[int] = field(default_factory=list)
    perplexity: float | None = None
    exact_match: bool | None = None
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / max(self.total_s, 1e-9)


# ---- the sampling section -------------------------------------------------------------------------------------
def sampling_variants(methods: Sequence[str], budget: int | None) -> list[Variant]:
    """``ar`` and the lossless policies among ``methods`` (node budget applied), for sampling.

    ``hf_generate``, ``hf_assisted`` and ``dsbd`` are left out; so is a policy whose configuration is lossy. A
    policy that cannot be built is kept with its ``error`` (its row reports it).
    """
    names = [m for m in dict.fromkeys([AR, *methods]) if m not in (*TRANSFORMERS_METHODS, DSBD)]
    return [v for v in build_variants(names, budget) if v.policy is None or v.policy.lossless]


def run_sampled(
    pipe: Any, variant: Variant, item: TaskInput, max_new_tokens: int, repeat: int, seed: int
) -> SampleRun:
    """Sample once with ``variant`` at temperature 1 (``top_k``/``top_p``: the target's ``generation_config``).

    A policy's recoverable error is recorded in the run; ``ar``'s is raised (it is the baseline).
    """
    warping = {"temperature": TEMPERATURE, "top_k": None, "top_p": None}
    return _engine_run(
        pipe, variant.key, variant.policy, item, max_new_tokens, repeat, seed, warping, variant.method == AR
    )


def _engine_run(
    pipe: Any,
    key: str,
    policy: TreePolicy,
    item: TaskInput,
    max_new_tokens: int,
    repeat: int,
    seed: int,
    warping: dict[str, Any],
    baseline: bool = False,
) -> SampleRun:
    """One sampled engine generation; a recoverable error is recorded in the run (raised for the ``baseline``)."""
    run = SampleRun(key=key, task=item.task, index=item.index, repeat=repeat, seed=seed)
    out, run.error = generate_with(
        pipe, policy, item, baseline, max_new_tokens=max_new_tokens, do_sample=True, seed=seed, **warping
    )
    if out is None:
        return run
    stats = out.stats
    run.token_ids, run.text = list(out.token_ids), out.text
    run.total_s, run.steps = stats.total_seconds, stats.steps
    run.tau, run.tokens_per_step, run.lossless = stats.mean_accepted, stats.tokens_per_step, stats.lossless
    run.widths = [
        int(t["output_beams"]) for t in stats.trace if t.get("gamma", 0) > 0 and "output_beams" in t
    ]
    return run


@torch.inference_mode()
def measure_sampling(
    pipe: Any,
    variants: Sequence[Variant],
    items: Sequence[TaskInput],
    max_new_tokens: int,
    repeats: int,
    seed: int,
    log: Logger,
) -> list[SampleRun]:
    """Warm every variant up on the first input, then sample with all of them interleaved per input and repeat.

    Repeat ``r`` uses seed ``seed + r`` for every method and input. A variant that failed on an input is not
    retried on that input's later repeats.
    """
    usable = {v.key: v for v in variants if v.error is None}

    def run(key: str, item: TaskInput, repeat: int) -> SampleRun:
        # the warm-up (repeat -1) samples with ``seed``, the first repeat's seed
        return run_sampled(pipe, usable[key], item, max_new_tokens, repeat, seed + max(repeat, 0))

    return interleaved(items, repeats, list(usable), run, log, "sampling ", warm_up=True)


def aggregate_sampling(
    runs: Sequence[SampleRun], variants: Sequence[Variant], tasks: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per variant and task (plus ``all`` tasks pooled when there are several), medians over runs."""
    ar_runs = {_run_key(r): r for r in runs if r.key == AR and r.error is None}
    groups = [*tasks, ALL_TASKS] if len(tasks) > 1 else list(tasks)
    rows = []
    for variant in variants:
        for task in groups:
            mine = [r for r in runs if r.key == variant.key and task in (ALL_TASKS, r.task)]
            rows.append(sampling_row(variant, task, mine, ar_runs))
    return rows


def sampling_row(
    variant: Variant, task: str, runs: Sequence[SampleRun], ar_runs: dict[tuple[str, int, int], SampleRun]
) -> dict[str, Any]:
    """The row of ``variant`` on ``task`` from its runs (module docstring: what each number is)."""
    ok = [r for r in runs if r.error is None]
    stepped = [r for r in ok if r.steps > 0]
    errors = [r.error for r in runs if r.error is not None]
    return {
        "method": variant.key,
        "task": task,
        "budget": variant.budget,
        "runs": len(ok),
        "tau": median_or_none([r.tau for r in stepped]),
        "tokens_per_step": median_or_none([r.tokens_per_step for r in stepped]),
        "tokens_per_s": median_or_none([r.tokens_per_s for r in ok]),
        "speedup": ratio_median(ok, ar_runs, _run_key),
        "new_tokens": median_or_none([len(r.token_ids) for r in ok]),
        "lossless": all(r.lossless for r in ok) if ok else None,
        "error": variant.error or (errors[0] if errors else None),
    }


def run_sampling_section(
    pipe: Any,
    items: Sequence[TaskInput],
    methods: Sequence[str],
    budget: int | None,
    max_new_tokens: int,
    repeats: int,
    seed: int,
    log: Logger,
) -> dict[str, Any]:
    """The ``--sampling`` section: ``{"settings", "rows"}`` (see the module docstring)."""
    variants = sampling_variants(methods, budget)
    params = SamplingParams.resolve(pipe.target.generation_config, temperature=TEMPERATURE)
    runs = measure_sampling(pipe, variants, items, max_new_tokens, repeats, seed, log)
    tasks = list(dict.fromkeys(it.task for it in items))
    return {
        "settings": {
            "methods": [v.key for v in variants],
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "seeds": f"seed + repeat ({seed}..{seed + repeats - 1})",
            "repeats": repeats,
            "inputs": len(items),
        },
        "rows": aggregate_sampling(runs, variants, tasks),
    }


# ---- the DSBD section -----------------------------------------------------------------------------------------
def dsbd_policy(options: dict[str, Any] | None = None) -> TreePolicy:
    """The ``dsbd`` policy with ``options`` over its paper defaults.

    Raises:
        ValueError: an unknown option or a bad value (the message names it and what is valid).
    """
    return get_policy(DSBD, **(options or {}))


def dsbd_warping(policy: TreePolicy) -> dict[str, Any]:
    """The sampling arguments of every DSBD-section run: temperature 1 and dsbd's top-k/top-p (paper: 10, 0.8)."""
    c = policy.config
    return {
        "temperature": TEMPERATURE,
        "top_k": PAPER_TOP_K if c.top_k is None else c.top_k,
        "top_p": PAPER_TOP_P if c.top_p is None else c.top_p,
    }


def run_dsbd(
    pipe: Any, policy: TreePolicy, item: TaskInput, max_new_tokens: int, repeat: int, seed: int
) -> SampleRun:
    """One DSBD generation (its recoverable errors are recorded in the run)."""
    return _engine_run(pipe, DSBD, policy, item, max_new_tokens, repeat, seed, dsbd_warping(policy))


def run_beam(
    pipe: Any,
    key: str,
    width: int,
    warping: dict[str, Any],
    item: TaskInput,
    max_new_tokens: int,
    repeat: int,
    seed: int,
) -> SampleRun:
    """One run of the target's own beam sampling (``width`` 1: multinomial sampling)."""
    run = SampleRun(key=key, task=item.task, index=item.index, repeat=repeat, seed=seed, widths=[width])
    try:
        out = beam_sampling_baseline(pipe, item.image, item.prompt, width=width, max_new_tokens=max_new_tokens,
                                     seed=seed, video=item.video, **warping)  # fmt: skip
    except BASELINE_ERRORS as err:
        run.error = f"{type(err).__name__}: {err}"
        return run
    run.token_ids, run.text, run.total_s = list(out.token_ids), out.text, out.seconds
    return run


def auto_beam_width(runs: Sequence[SampleRun], w_min: int) -> int:
    """DSBD's output width: the rounded mean number of output beams per drafted step (``w_min`` without any)."""
    widths = [w for r in runs if r.error is None for w in r.widths]
    return max(1, round(statistics.fmean(widths))) if widths else w_min


def score_runs(pipe: Any, runs: Sequence[SampleRun], items: Sequence[TaskInput]) -> None:
    """Fill each run's perplexity under the target and exact match against its input's reference (untimed)."""
    by_key = {(it.task, it.index): it for it in items}
    prepared: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for run in runs:
        if run.error is not None or not run.token_ids:
            continue
        item = by_key[run.task, run.index]
        key = (item.task, item.index)
        if key not in prepared:
            prepared[key] = pipe.prepare_inputs(item.image, item.prompt, item.video)
        run.perplexity = perplexity(pipe, prepared[key], run.token_ids)
        if item.reference is not None:
            run.exact_match = run.text.strip() == item.reference.strip()


@torch.inference_mode()
def measure_dsbd(
    pipe: Any,
    policy: TreePolicy,
    items: Sequence[TaskInput],
    beam_width: int | None,
    max_new_tokens: int,
    repeats: int,
    seed: int,
    log: Logger,
) -> tuple[list[SampleRun], int, str]:
    """Warm up, choose the beam width, then run dsbd, beam sampling and multinomial sampling interleaved.

    Returns:
        ``(runs, beam width, a sentence saying where the width came from)``.
    """
    warping = dsbd_warping(policy)
    warm_items = items if beam_width is None else items[:1]
    warm = [run_dsbd(pipe, policy, item, max_new_tokens, -1, seed) for item in warm_items]
    if beam_width is None:
        width = auto_beam_width(warm, policy.config.w_min)
        note = f"auto: dsbd's mean output beams per drafted step in a warm-up run on every input, rounded ({width})"
    else:
        width, note = beam_width, f"{beam_width} (--beam-width)"
    widths = {BEAM_SAMPLING: width, MULTINOMIAL: 1}
    for key, w in widths.items():
        run_beam(pipe, key, w, warping, items[0], max_new_tokens, -1, seed)

    def run(key: str, item: TaskInput, repeat: int) -> SampleRun:
        if key == DSBD:
            return run_dsbd(pipe, policy, item, max_new_tokens, repeat, seed + repeat)
        return run_beam(pipe, key, widths[key], warping, item, max_new_tokens, repeat, seed + repeat)

    runs = interleaved(items, repeats, DSBD_METHODS, run, log, "dsbd ")
    return runs, width, note


def dsbd_rows(runs: Sequence[SampleRun], width: int) -> list[dict[str, Any]]:
    """One row per DSBD-section method (module docstring: what each number is)."""
    beam = {_run_key(r): r for r in runs if r.key == BEAM_SAMPLING and r.error is None}
    widths = {BEAM_SAMPLING: width, MULTINOMIAL: 1}
    rows = []
    for key in DSBD_METHODS:
        mine = [r for r in runs if r.key == key]
        ok = [r for r in mine if r.error is None]
        matches = [r.exact_match for r in ok if r.exact_match is not None]
        rows.append(
            {
                "method": key,
                "width": mean_or_none([w for r in ok for w in r.widths])
                if key == DSBD
                else float(widths[key]),
                "runs": len(ok),
                "tokens_per_s": median_or_none([r.tokens_per_s for r in ok]),
                "speedup": ratio_median(ok, beam, _run_key),
                "perplexity": mean_or_none([r.perplexity for r in ok if r.perplexity is not None]),
                "exact_match": mean_or_none(matches),
                "tau": median_or_none([r.tau for r in ok if r.steps > 0]) if key == DSBD else None,
                "new_tokens": median_or_none([len(r.token_ids) for r in ok]),
                "error": next((r.error for r in mine if r.error is not None), None),
            }
        )
    return rows


def run_dsbd_section(
    pipe: Any,
    n: int,
    seed: int,
    source: str,
    options: dict[str, Any] | None,
    beam_width: int | None,
    max_new_tokens: int,
    repeats: int,
    log: Logger,
) -> dict[str, Any]:
    """The ``--dsbd`` section on ``n`` ``image_qa`` inputs: ``{"settings", "rows"}`` (see the module docstring)."""
    policy = dsbd_policy(options)
    items = load_inputs([QA_TASK], n, seed, source)
    start = time.perf_counter()
    runs, width, note = measure_dsbd(pipe, policy, items, beam_width, max_new_tokens, repeats, seed, log)
    score_runs(pipe, runs, items)
    log(f"dsbd section done in {time.perf_counter() - start:.1f}s")
    return {
        "settings": {
            "task": QA_TASK,
            "inputs": len(items),
            "inputs_source": items[0].source,
            "references": sum(it.reference is not None for it in items),
            "repeats": repeats,
            "seeds": f"seed + repeat ({seed}..{seed + repeats - 1})",
            "dsbd_config": asdict(policy.config),
            "beam_width": width,
            "beam_width_note": note,
            **dsbd_warping(policy),
        },
        "rows": dsbd_rows(runs, width),
    }


def _run_key(run: SampleRun) -> tuple[str, int, int]:
    return run.task, run.index, run.repeat
