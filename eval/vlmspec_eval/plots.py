"""PNG plots of a bench result (matplotlib, Agg backend; imported only when plotting).

``speedup.png`` (speed-up per method and task, ideal speed-up as markers), ``tau_vs_length.png`` (SAGE Fig. 3),
``entropy_autocorr.png`` (Fig. 2), ``time_breakdown.png`` (Table 6), ``prune_ablation.png`` (Table 5) and
``cost_probe.png`` (verification cost vs tree size, with the budget used).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cost import PHASES
from .report import phase_shares


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write every plot the result has data for; returns name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    makers: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
        "speedup": plot_speedup,
        "tau_vs_length": plot_tau_vs_length,
        "entropy_autocorr": plot_entropy_autocorr,
        "time_breakdown": plot_time_breakdown,
        "prune_ablation": plot_prune_ablation,
        "cost_probe": plot_cost_probe,
    }
    written = {}
    for name, make in makers.items():
        fig = make(plt, result)
        if fig is None:
            continue
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written[name] = path
    return written


def plot_speedup(plt: Any, result: dict[str, Any]) -> Any:
    rows = [r for r in result["rows"] if r["speedup"] is not None]
    if not rows:
        return None
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cells = {(r["method"], r["task"]): r for r in rows}
    width = 0.8 / max(len(tasks), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(methods), 3.6))
    for j, task in enumerate(tasks):
        xs = [i + (j - (len(tasks) - 1) / 2) * width for i in range(len(methods))]
        values = [cells[m, task]["speedup"] if (m, task) in cells else 0.0 for m in methods]
        ax.bar(xs, values, width, label=task)
        ideal = [(x, cells[m, task]["ideal_speedup"]) for x, m in zip(xs, methods, strict=False)
                 if (m, task) in cells and cells[m, task]["ideal_speedup"] is not None]  # fmt: skip
        if ideal:
            ax.scatter(*zip(*ideal, strict=False), marker="_", s=160, color="black", zorder=3)
    ax.scatter([], [], marker="_", s=160, color="black", label="ideal (no overhead)")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(methods)), methods)
    ax.set(ylabel="speed-up over AR (tokens/s)", title="Speed-up per method")
    ax.legend(fontsize=8)
    return fig


def plot_tau_vs_length(plt: Any, result: dict[str, Any]) -> Any:
    curves = result.get("tau_vs_length") or {}
    if not curves:
        return None
    lines = [(method, curve["lengths"], curve["tau"], {}) for method, curve in curves.items()]
    title = "Acceptance length vs generation length"
    return _line_chart(plt, lines, "generation length (tokens)", "tau (running mean)", title)


def plot_entropy_autocorr(plt: Any, result: dict[str, Any]) -> Any:
    report = result.get("entropy_autocorr") or {}
    if not report:
        return None
    lines = []
    for task, values in report.items():
        lags = [int(k) for k, v in values["autocorr"].items() if v is not None]
        corr = [v for v in values["autocorr"].values() if v is not None]
        if lags:
            lines.append((task, lags, corr, {"marker": "o", "lw": 2.0 if task == "all" else 1.0}))
    title = "Entropy autocorrelation along generations"
    return _line_chart(plt, lines, "lag (tokens)", "Pearson r of target entropy", title, zero_line=True)


def _line_chart(
    plt: Any,
    lines: Sequence[tuple[str, Sequence[float], Sequence[float], dict[str, Any]]],
    xlabel: str,
    ylabel: str,
    title: str,
    zero_line: bool = False,
) -> Any:
    """A small figure of labelled lines ``(label, xs, ys, plot options)``."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for label, xs, ys, options in lines:
        ax.plot(xs, ys, label=label, **options)
    if zero_line:
        ax.axhline(0.0, color="gray", lw=0.8)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_time_breakdown(plt: Any, result: dict[str, Any]) -> Any:
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    shares = {m: phase_shares([r for r in result["rows"] if r["method"] == m]) for m in methods}
    shares = {m: s for m, s in shares.items() if s is not None}
    if not shares:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 0.6 + 0.45 * len(shares)))
    left = [0.0] * len(shares)
    for phase in PHASES:
        values = [s[phase] for s in shares.values()]
        ax.barh(list(shares), values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values, strict=False)]
    ax.set(xlim=(0, 1), xlabel="share of wall time", title="Time per phase")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(shares)))
    return fig


def plot_prune_ablation(plt: Any, result: dict[str, Any]) -> Any:
    rows = [r for r in result.get("ablation") or [] if r["tau"] is not None]
    if not rows:
        return None
    fig, (ax_tau, ax_tps) = plt.subplots(1, 2, figsize=(8, 3.2))
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = sorted((r for r in rows if r["task"] == task), key=lambda r: r["prune_ratio"])
        ratios = [r["prune_ratio"] for r in mine]
        ax_tau.plot(ratios, [r["tau"] for r in mine], marker="o", label=task)
        ax_tps.plot(ratios, [r["tokens_per_s"] for r in mine], marker="o", label=task)
    ax_tau.set(xlabel="draft visual prune ratio", ylabel="tau")
    ax_tps.set(xlabel="draft visual prune ratio", ylabel="tokens/s")
    ax_tau.legend(fontsize=8)
    fig.suptitle("SAGE with draft visual-token pruning")
    fig.tight_layout()
    return fig


def plot_cost_probe(plt: Any, result: dict[str, Any]) -> Any:
    probe = result.get("cost_probe")
    if not probe:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(probe["sizes"], probe["target_ratio"], marker="o", label="target")
    if probe.get("draft_ratio"):
        ax.plot(probe["sizes"], probe["draft_ratio"], marker="o", label="draft")
    settings = result["settings"]
    budget = settings.get("budget")
    if isinstance(budget, int):
        ax.axvline(budget + 1, color="gray", ls="--", lw=0.8, label=f"budget {budget} (+root)")
    if settings.get("budget_mode") == "auto":
        ax.axhline(settings["auto_factor"], color="red", ls=":", lw=0.8, label="auto factor")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens per forward N", ylabel="cost(N) / cost(1)", title="Tree forward cost")
    ax.legend(fontsize=8)
    return fig
