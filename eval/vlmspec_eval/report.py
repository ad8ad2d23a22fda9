"""Turning run records into the bench's rows and writing them as markdown, CSV and JSON.

Aggregation of one (method, task) cell over its inputs and repeats:

* ``tokens_per_s``: per input the median over repeats, then the mean over inputs.
* ``speedup``: per input and repeat the ratio to ``hf_generate``'s tokens/s (transformers' own greedy
  ``generate()``, what users have today) *in the same repeat round* (methods run interleaved, so a slow moment
  of the machine hits both), median over repeats, mean over inputs. ``speedup_ar``: the same over ``ar`` (the
  engine's own plain decoding). Without ``hf_generate`` runs, ``speedup`` is over ``ar``.
* ``overhead_share`` and the time per phase: median over repeats (phases: of the median-time run), mean over inputs.
* ``tau``, ``tokens_per_step``, ``nodes_per_step``: pooled over inputs (sums over steps; greedy decoding makes
  them identical across repeats, the first repeat is used). ``ideal_speedup``: ratio of pooled sums (see cost.py).
* ``identical``: every run's tokens equal AR's for the same input; for ``ar`` itself, equal to the target's own
  ``generate(do_sample=False)``.

The optional sampling and DSBD sections (``sampling_rows``, ``dsbd_rows``; aggregated in :mod:`.sampling`) get
their own markdown tables and CSV files (``bench_sampling.csv``, ``bench_dsbd.csv``).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cost import PHASES, CostProbe, ideal_terms, overhead_share, phase_breakdown, probe_overhead_share
from .methods import AR, HF_GENERATE, RunRecord, Variant

REQUIRED_ROW_KEYS: tuple[str, ...] = (
    "method", "task", "tau", "tokens_per_step", "tokens_per_s", "speedup", "identical", "budget", "nodes_per_step",
    "ideal_speedup", "overhead_share", "error",
)  # fmt: skip
CSV_KEYS: tuple[str, ...] = (
    "key", *REQUIRED_ROW_KEYS, "speedup_ar", "overhead_share_probe", "prune_ratio", "inputs", "repeats", "new_tokens",
    "steps", "draft_visual_tokens", "target_visual_tokens", *(f"phase_{p}_s" for p in PHASES),
)  # fmt: skip
SAMPLING_CSV_KEYS: tuple[str, ...] = (
    "method", "task", "budget", "runs", "tau", "tokens_per_step", "tokens_per_s", "speedup", "new_tokens",
    "lossless", "error",
)  # fmt: skip
DSBD_CSV_KEYS: tuple[str, ...] = (
    "method", "width", "runs", "tokens_per_s", "speedup", "perplexity", "exact_match", "tau", "new_tokens", "error",
)  # fmt: skip
_PHASE_LABELS = {
    "target_prefill": "target prefill",
    "draft_prefill": "draft prefill",
    "draft_forward": "draft forwards",
    "tree_build": "tree building",
    "verify_forward": "verify forward",
    "accept_update": "accept+cache",
    "other": "other",
}


# ---- aggregation ----------------------------------------------------------------------------------------------
def aggregate(
    records: Sequence[RunRecord],
    variants: Sequence[Variant],
    tasks: Sequence[str],
    references: dict[tuple[str, int], list[int]],
    probe: CostProbe | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Main rows (method x task) and prune-ablation rows from all records.

    Args:
        records: every timed run.
        variants: what ran (``ar`` among them).
        tasks: task order of the rows.
        references: the target's own greedy output per ``(task, index)``.
        probe: the cost probe (``None``: no ideal speed-up); a variant on its own pipeline (the EDD rows) is priced
            with that pipeline's probe, its own draft's costs.
    """
    by_cell: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    for record in records:
        by_cell[record.key, record.task].append(record)
    rows, ablation = [], []
    for variant in variants:
        for task in tasks:
            ar_runs = {(r.index, r.repeat): r for r in by_cell[AR, task] if r.error is None}
            hf_runs = {(r.index, r.repeat): r for r in by_cell[HF_GENERATE, task] if r.error is None}
            own = getattr(variant.pipe, "costs", None)
            cell_probe = own if isinstance(own, CostProbe) else probe
            row = cell_row(
                variant, task, by_cell[variant.key, task], ar_runs, references, cell_probe, hf_runs or None
            )
            (ablation if variant.ablation else rows).append(row)
    return rows, ablation


def cell_row(
    variant: Variant,
    task: str,
    runs: Sequence[RunRecord],
    ar_runs: dict[tuple[int, int], RunRecord],
    references: dict[tuple[str, int], list[int]],
    probe: CostProbe | None,
    baseline_runs: dict[tuple[int, int], RunRecord] | None = None,
) -> dict[str, Any]:
    """One row: ``variant`` on ``task`` aggregated as the module docstring says (``speedup`` over
    ``baseline_runs``, ``hf_generate``'s, else over ``ar_runs``)."""
    ok = [r for r in runs if r.error is None]
    errors = [r.error for r in runs if r.error is not None]
    row: dict[str, Any] = {
        "key": variant.key,
        "method": variant.method,
        "task": task,
        "budget": variant.budget,
        "prune_ratio": variant.prune_ratio,
        "error": variant.error or _error_text(errors, runs),
        "inputs": len({r.index for r in ok}),
        "repeats": max((r.repeat + 1 for r in ok), default=0),
    }
    if not ok:
        return {**{k: None for k in CSV_KEYS if not k.startswith("phase_")}, **row, "phases": None}
    per_input: dict[int, list[RunRecord]] = defaultdict(list)
    for r in ok:
        per_input[r.index].append(r)
    by_run = lambda r: (r.index, r.repeat)  # noqa: E731
    firsts = [min(reps, key=lambda r: r.repeat) for reps in per_input.values()]
    steps = sum(r.steps for r in firsts)
    sizes = [s for r in firsts for s in r.tree_sizes]
    terms = [t for t in (ideal_terms(r, probe) for r in firsts) if t is not None]
    medians = [_median_run(reps) for reps in per_input.values()]
    phases = {p: _mean(phase_breakdown(m)[p] for m in medians) for p in PHASES}
    row.update(
        tau=sum(r.accepted for r in firsts) / max(steps, 1),
        tokens_per_step=sum(r.decoded_tokens for r in firsts) / max(steps, 1),
        tokens_per_s=_mean(statistics.median(r.tokens_per_s for r in reps) for reps in per_input.values()),
        speedup=mean_or_none(
            ratio_median(reps, baseline_runs or ar_runs, by_run) for reps in per_input.values()
        ),
        speedup_ar=mean_or_none(ratio_median(reps, ar_runs, by_run) for reps in per_input.values()),
        nodes_per_step=sum(sizes) / len(sizes) if sizes else 0.0,
        ideal_speedup=sum(t[0] for t in terms) / sum(t[1] for t in terms) if terms else None,
        overhead_share=_mean(
            statistics.median(overhead_share(r) for r in reps) for reps in per_input.values()
        ),
        overhead_share_probe=mean_or_none(
            median_or_none(probe_overhead_share(r, probe) for r in reps) for reps in per_input.values()
        ),
        identical=all(r.token_ids == _expected(variant, r, ar_runs, references) for r in ok),
        new_tokens=_mean(r.new_tokens for r in firsts),
        steps=_mean(r.steps for r in firsts),
        draft_visual_tokens=mean_or_none(r.draft_visual_tokens for r in firsts),
        target_visual_tokens=mean_or_none(r.target_visual_tokens for r in firsts),
        phases=phases,
    )
    return row


def _expected(
    variant: Variant, run: RunRecord, ar_runs: dict[tuple[int, int], RunRecord], references: dict
) -> list[int] | None:
    if variant.method == AR and not variant.ablation:
        return references.get((run.task, run.index))
    ar = ar_runs.get((run.index, 0)) or next((r for (i, _), r in ar_runs.items() if i == run.index), None)
    return ar.token_ids if ar is not None else None


def ratio_median(runs: Sequence[Any], base: dict[Any, Any], key: Any) -> float | None:
    """Median over ``runs`` of each run's tokens/s over that of ``base[key(run)]`` (runs without one skipped)."""
    return median_or_none([r.tokens_per_s / base[key(r)].tokens_per_s for r in runs if key(r) in base])


def _median_run(reps: Sequence[RunRecord]) -> RunRecord:
    ordered = sorted(reps, key=lambda r: r.total_s)
    return ordered[(len(ordered) - 1) // 2]


def _error_text(errors: Sequence[str], runs: Sequence[RunRecord]) -> str | None:
    if not errors:
        return None
    failed = len({r.index for r in runs if r.error is not None})
    total = len({r.index for r in runs})
    return errors[0] if failed == total else f"{failed}/{total} inputs failed: {errors[0]}"


def _mean(values) -> float:
    return mean_or_none(values) or 0.0


def mean_or_none(values) -> float | None:
    """The mean of the values that are not ``None`` (``None`` when there are none)."""
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else None


def median_or_none(values) -> float | None:
    """The median of the values that are not ``None`` (``None`` when there are none)."""
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


# ---- markdown -------------------------------------------------------------------------------------------------
def _quantized(pair: dict[str, Any]) -> str:
    """``", target quanto"``-like words for the pair's quantized models (``""`` when none is)."""
    methods = pair.get("quantization") or {}
    return "".join(f", {role} {method}" for role, method in methods.items() if method)


def fmt(value: Any, spec: str = ".2f") -> str:
    """A table cell: ``-`` for ``None`` or a non-finite float, yes/NO for a bool, ``spec`` for a float."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec) if math.isfinite(value) else "-"
    return str(value)


def table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def rows_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, ...]]) -> str:
    """A markdown table of ``rows``, one column per ``(header, key[, format spec])`` (``error``: shortened)."""
    lines = [
        [_short(r.get(key)) if key == "error" else fmt(r.get(key), *spec) for _, key, *spec in columns]
        for r in rows
    ]
    return table([c[0] for c in columns], lines)


MAIN_COLUMNS = (("method", "method"), ("task", "task"), ("budget", "budget"), ("tau", "tau"),
                ("tok/step", "tokens_per_step"), ("tok/s", "tokens_per_s", ".1f"), ("speed-up", "speedup"),
                ("vs ar", "speedup_ar"), ("nodes/step", "nodes_per_step", ".1f"), ("ideal speed-up", "ideal_speedup"),
                ("overhead", "overhead_share", ".0%"), ("identical", "identical"), ("error", "error"))  # fmt: skip
"""The full method x task table."""
ABLATION_COLUMNS = (("prune ratio", "prune_ratio", "g"), ("task", "task"),
                    ("draft visual tokens", "draft_visual_tokens", ".0f"), ("tau", "tau"),
                    ("tok/s", "tokens_per_s", ".1f"), ("speed-up", "speedup"), ("identical", "identical"),
                    ("error", "error"))  # fmt: skip
"""SAGE Table 5 style: sage per prune ratio and task: tau and tokens/s."""
SAMPLING_COLUMNS = (("method", "method"), ("task", "task"), ("budget", "budget"), ("runs", "runs"), ("tau", "tau"),
                    ("tok/step", "tokens_per_step"), ("tok/s", "tokens_per_s", ".1f"), ("speed-up", "speedup"),
                    ("tokens", "new_tokens", ".0f"), ("lossless", "lossless"), ("error", "error"))  # fmt: skip
"""The sampling section: per method and task, medians of tau, tokens/step, tokens/s and speed-up over AR."""
DSBD_COLUMNS = (("method", "method"), ("width", "width"), ("runs", "runs"), ("tok/s", "tokens_per_s", ".1f"),
                ("speed-up", "speedup"), ("perplexity", "perplexity", ".3f"), ("exact match", "exact_match", ".0%"),
                ("tau", "tau"), ("tokens", "new_tokens", ".0f"), ("error", "error"))  # fmt: skip
"""The DSBD section: tokens/s, speed-up over beam sampling, perplexity and exact match per method."""


def summary_table(rows: Sequence[dict[str, Any]], tasks: Sequence[str]) -> str:
    """SAGE Table 1 style: one line per method, ``speed-up (tau)`` per task and their mean."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["method"], r["task"]): r for r in rows}
    lines = []
    for method in methods:
        mine = [cells[method, t] for t in tasks if (method, t) in cells]
        line = [method, fmt(mine[0]["budget"]) if mine else "-"]
        for task in tasks:
            r = cells.get((method, task))
            line.append(
                "-" if r is None or r["speedup"] is None else f"{r['speedup']:.2f}x ({fmt(r['tau'])})"
            )
        speedups = [r["speedup"] for r in mine if r["speedup"] is not None]
        taus = [r["tau"] for r in mine if r["tau"] is not None]
        line.append(f"{_mean(speedups):.2f}x ({_mean(taus):.2f})" if speedups else "-")
        identical = [r["identical"] for r in mine]
        line.append(fmt(all(identical) if identical and None not in identical else None))
        lines.append(line)
    return table(["method", "budget", *(f"{t} speed-up (tau)" for t in tasks), "mean", "identical"], lines)


def phase_table(rows: Sequence[dict[str, Any]]) -> str:
    """SAGE Table 6 style: share of the wall time per phase, per method (mean over tasks)."""
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        shares = phase_shares([r for r in rows if r["method"] == method])
        if shares is not None:
            lines.append([method, *(fmt(shares[p], ".0%") for p in PHASES)])
    return table(["method", *(_PHASE_LABELS[p] for p in PHASES)], lines)


def phase_shares(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Mean over ``rows`` of each phase's share of the row's total time."""
    totals = [(r["phases"], sum(r["phases"].values())) for r in rows if r.get("phases")]
    totals = [(p, t) for p, t in totals if t > 0]
    if not totals:
        return None
    return {ph: _mean(p[ph] / t for p, t in totals) for ph in PHASES}


def probe_table(probe: dict[str, Any]) -> str:
    """Cost probe: ms per forward and ratio to one token, target (with its roofline) and draft."""
    n = len(probe["sizes"])
    draft = probe.get("draft_s") or [None] * n
    draft_ratio = probe.get("draft_ratio") or [None] * n
    roof = probe.get("roofline_s") or [None] * n
    lines = [
        [str(size), fmt(t * 1e3), fmt(tr), fmt(r * 1e3 if r else None, ".3f"), fmt(t / r if r else None, ".1f"),
         fmt(d * 1e3 if d is not None else None), fmt(dr)]
        for size, t, tr, r, d, dr in zip(
            probe["sizes"], probe["target_s"], probe["target_ratio"], roof, draft, draft_ratio, strict=False
        )
    ]  # fmt: skip
    header = ["tokens N", "target ms (median)", "target c(N)/c(1)", "target roofline ms", "c(N)/roofline",
              "draft ms (median)", "draft c(N)/c(1)"]  # fmt: skip
    return table(header, lines)


def roofline_note(probe: dict[str, Any]) -> str:
    """One sentence: the machine's measured bandwidth and peak, and the target's bytes and FLOPs."""
    roof = probe.get("roofline")
    if not roof:
        return ""
    return (
        f"Roofline: target weights {roof['weight_bytes'] / 2**20:.1f} MiB read per forward at a measured "
        f"{roof['bandwidth'] / 1e9:.1f} GB/s, {roof['flops_per_token'] / 1e9:.3f} GFLOP per token at a measured "
        f"{roof['peak_flops'] / 1e12:.2f} TFLOP/s peak; roofline ms = max(bytes / bandwidth, N * FLOPs / peak)."
    )


def edd_share(draft_s: float, target_s: float) -> str:
    """The EDD draft's one-token forward cost as a share of the target's."""
    return f"one draft forward {draft_s * 1e3:.2f} ms = {draft_s / target_s:.1%} of a target forward ({target_s * 1e3:.2f} ms)"


def entropy_table(report: dict[str, Any]) -> str:
    """Entropy autocorrelation per task and lag."""
    lags = list(next(iter(report.values()))["autocorr"]) if report else []
    lines = [
        [task, str(v["tokens"]), fmt(v["mean_entropy"]), *(fmt(v["autocorr"][k]) for k in lags)]
        for task, v in report.items()
    ]
    return table(["task", "tokens", "mean entropy", *(f"lag {k}" for k in lags)], lines)


def section(title: str, body: str, note: str = "") -> list[str]:
    """Markdown lines of one report section: a blank line, the heading, the table, and the note under it if any."""
    return ["", f"## {title}", "", body, *(["", note] if note else [])]


def settings_section(
    result: dict[str, Any],
    name: str,
    columns: Sequence[tuple[str, ...]],
    texts: Callable[[dict[str, Any]], tuple[str, str]],
) -> list[str]:
    """Markdown lines of an optional section: the table of ``result["<name>_rows"]`` under the heading and above
    the note that ``texts`` makes of ``result["<name>_settings"]``; empty when the section did not run."""
    if f"{name}_rows" not in result:
        return []
    heading, note = texts(result[f"{name}_settings"])
    return section(heading, rows_table(result[f"{name}_rows"], columns), note)


def sampling_markdown(result: dict[str, Any]) -> list[str]:
    """Markdown lines of the sampling section (empty when it did not run)."""
    return settings_section(result, "sampling", SAMPLING_COLUMNS, _sampling_texts)


def _sampling_texts(s: dict[str, Any]) -> tuple[str, str]:
    """The sampling section's heading and note, from its settings."""
    heading = (
        f"Sampling (temperature {fmt(s['temperature'], 'g')}, top_k {fmt(s['top_k'])}, top_p "
        f"{fmt(s['top_p'], 'g')}; medians over inputs x repeats)"
    )
    note = (
        f"Seeds: {s['seeds']}, the same for every method; speed-up: median of each run's tokens/s over ar's "
        "in the same input and repeat; tau and tok/step over runs with at least one verification step."
    )
    return heading, note


def dsbd_markdown(result: dict[str, Any]) -> list[str]:
    """Markdown lines of the DSBD section (empty when it did not run)."""
    return settings_section(result, "dsbd", DSBD_COLUMNS, _dsbd_texts)


def _dsbd_texts(s: dict[str, Any]) -> tuple[str, str]:
    """The DSBD section's heading and note, from its settings."""
    c = s["dsbd_config"]
    heading = (
        f"DSBD vs beam sampling ({s['task']}, {s['inputs']} {s['inputs_source']} inputs x {s['repeats']} "
        f"repeats; temperature {fmt(s['temperature'], 'g')}, top_k {s['top_k']}, top_p {fmt(s['top_p'], 'g')})"
    )
    note = (
        f"dsbd: gamma {c['gamma']}, draft width {c['draft_width']}, threshold {fmt(c['threshold'], 'g')}, "
        f"w_min {c['w_min']} (width: mean output beams per drafted step); beam_sampling: the target's "
        f"generate(num_beams=W, do_sample=True), W = {s['beam_width_note']}; multinomial: num_beams=1. "
        "tok/s: median; speed-up: median ratio to beam_sampling in the same input and repeat; perplexity: "
        f"under the target (raw distribution), mean; exact match: reply stripped == reference "
        f"({s['references']} of {s['inputs']} inputs have one). Seeds: {s['seeds']}."
    )
    return heading, note


def _baseline_name(rows: Sequence[dict[str, Any]]) -> str:
    if any(r["method"] == HF_GENERATE and r["tokens_per_s"] for r in rows):
        return "transformers' generate() (hf_generate)"
    return "AR"


def _short(text: str | None, width: int = 80) -> str:
    if not text:
        return ""
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= width else text[: width - 3] + "..."


def markdown(result: dict[str, Any]) -> str:
    """The whole report as markdown."""
    pair, settings = result["pair"], result["settings"]
    parts = [
        "# vlmspec bench",
        "",
        f"- pair: target `{pair['target']}`, draft `{pair['draft']}` ({pair['source']}, {pair['family']}, "
        f"{pair['dtype']}{_quantized(pair)}; {fmt(pair.get('target_params_m'), '.1f')}M / "
        f"{fmt(pair.get('draft_params_m'), '.1f')}M params)",
        f"- device: {result['device']}",
        f"- inputs: {settings['inputs_source']}, {settings['n']} per task x {settings['repeats']} repeats "
        f"(interleaved, medians), max_new_tokens {settings['max_new_tokens']}, seed {settings['seed']}",
        f"- node budget: {settings['budget_note']}",
    ]
    parts += section(
        f"Summary (speed-up over {_baseline_name(result['rows'])}, tau in brackets)",
        summary_table(result["rows"], settings["tasks"]),
    )
    parts += section(
        "All metrics",
        rows_table(result["rows"], MAIN_COLUMNS),
        "tau: accepted draft tokens per step; ideal speed-up: with zero engine overhead (probe costs of the "
        "forwards made, decode phase); overhead: share of wall time outside model forwards and prefills.",
    )
    parts += section("Time per phase (share of wall time, mean over tasks)", phase_table(result["rows"]))
    if result.get("ablation"):
        parts += section(
            "Draft visual-token pruning ablation (sage)", rows_table(result["ablation"], ABLATION_COLUMNS)
        )
    if result.get("entropy_autocorr"):
        parts += section(
            "Target entropy autocorrelation (AR outputs)", entropy_table(result["entropy_autocorr"])
        )
    if result.get("cost_probe"):
        probe = result["cost_probe"]
        parts += section(
            f"Cost probe (after a {probe['prefix_tokens']}-token {probe['task']} prompt, median of {probe['runs']} "
            "undisturbed rounds)",
            probe_table(probe),
            "c(N)/c(1) uses the medians' non-decreasing envelope (noise spikes removed); it prices the ideal "
            "speed-up and --budget auto. "
            + roofline_note(probe)
            + (
                ""
                if probe.get("settled", True)
                else " **The machine was busy during the probe: too few rounds "
                "ran undisturbed, so these costs are unreliable; run the bench again on a quiet machine.**"
            ),
        )
    if result.get("edd_cost_probe"):
        edd = result["edd_cost_probe"]
        share = edd_share(edd["draft_s"][0], edd["target_s"][0])
        parts += ["", f"EDD draft (the edd+ rows, its own budgets from its own probe): {share}."]
    parts += sampling_markdown(result) + dsbd_markdown(result)
    return "\n".join(parts) + "\n"


# ---- files ----------------------------------------------------------------------------------------------------
def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf replaced by ``None`` and tuples/paths made JSON-friendly."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def csv_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows flattened for CSV (phases as ``phase_<name>_s`` columns)."""
    return [{**r, **{f"phase_{p}_s": (r.get("phases") or {}).get(p) for p in PHASES}} for r in rows]


def _write_csv(path: Path, keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(keys))
        writer.writeheader()
        writer.writerows([{k: json_safe(r.get(k)) for k in keys} for r in rows])


def write_files(result: dict[str, Any], out_dir: Path, json_path: Path | None = None) -> dict[str, Path]:
    """Write ``bench.md``, ``bench.csv`` (main and ablation rows) and ``bench.json`` (plus ``json_path``); with
    the sampling/DSBD sections also ``bench_sampling.csv`` / ``bench_dsbd.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "bench.md", "csv": out_dir / "bench.csv", "json": out_dir / "bench.json"}
    paths["md"].write_text(markdown(result))
    _write_csv(paths["csv"], CSV_KEYS, csv_rows([*result["rows"], *result.get("ablation", [])]))
    for name, keys in (("sampling", SAMPLING_CSV_KEYS), ("dsbd", DSBD_CSV_KEYS)):
        if f"{name}_rows" in result:
            paths[f"csv_{name}"] = out_dir / f"bench_{name}.csv"
            _write_csv(paths[f"csv_{name}"], keys, result[f"{name}_rows"])
    text = json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n"
    paths["json"].write_text(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text)
        paths["json_extra"] = json_path
    return paths


def write_section(out: Path, name: str, text: str) -> int:
    """Write a section's markdown ``text`` to ``<out>/<name>`` and say so on stderr; the exit status 0."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0
