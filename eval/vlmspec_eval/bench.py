"""``vlmspec bench``: speed of every decoding method on one target/draft pair and a task mix (SAGE Table 1 style).

For a pair (the testbed's ``base`` pair by default) and the tasks image caption, image QA and video caption, every
method runs on the same inputs: ``ar`` (baseline), ``hf_assisted`` (transformers' assisted generation with the same
draft) and every registered policy but ``ar``. The bench

1. probes the target's and draft's tree-forward cost for ``N = 1..128`` tokens (see :mod:`.cost`) and installs
   it as ``pipe.costs``: under ``--budget auto`` (the default) every policy's node budget and depth are fitted to
   it, the way a pipeline fits them to its own probe (:mod:`vlmspec.costs`);
2. computes the target's own greedy ``generate()`` output per input (the lossless reference of ``ar``);
3. warms every method up once, then for each input and repeat runs every method in turn (interleaved, the order
   rotated per repeat) so machine noise hits all of them alike;
4. analyses the target's entropy along the AR outputs and the per-step acceptance traces;
5. optionally (``--sampling``, ``--dsbd``) runs the sampling sections of :mod:`.sampling`: ``ar`` and the lossless
   policies sampling at temperature 1, and DSBD against the target's beam and multinomial sampling on image QA;
6. writes ``bench.md`` (also printed), ``bench.csv``, ``bench.json`` (and ``bench_sampling.csv``,
   ``bench_dsbd.csv`` with those sections) and PNG plots into ``--out``.

API::

    from vlmspec_eval.bench import BenchConfig, run_bench, write_report
    result = run_bench(BenchConfig(target="t/", draft="d/", tasks=("image_caption",), n=2))
    write_report(result, Path("bench_out"))
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from vlmspec import StructuredOutputs
from vlmspec.cli import check_output_path
from vlmspec.costs import DEFAULT_BUDGET_FACTOR, check_budget_factor
from vlmspec.named_pairs import ResolvedPair
from vlmspec.probe import check_sizes
from vlmspec.quantization import quantization_description, resolve_quantization_config

from .analysis import entropy_report, tau_vs_length, token_entropies
from .bench_cli import DEFAULT_PRUNE_RATIOS, DTYPES, INPUT_SOURCES, PROBE_SIZES, TASKS
from .bench_cli import add_arguments as add_arguments
from .bench_cli import build_parser as build_parser
from .cost import choose_budget, run_cost_probe
from .methods import (
    AR,
    EDD_PREFIX,
    RunRecord,
    Variant,
    build_variants,
    check_section_policies,
    edd_variants,
    interleaved,
    resolve_methods,
    run_variant,
)
from .report import aggregate, edd_share, markdown, write_files
from .sampling import dsbd_policy, run_dsbd_section, run_sampling_section
from .tasks import (
    TaskInput,
    check_pair,
    check_tasks,
    load_config_pair,
    load_edd_pipeline,
    load_inputs,
)


@dataclass
class BenchConfig:
    """Everything a bench run needs: one field per ``vlmspec bench`` option (see :func:`add_arguments` for what
    each means), with ``json_path`` for ``--json``, ``plots`` for ``not --no-plots``, ``verbose`` for ``not --quiet``.

    ``target``/``draft`` both ``None``: the default pair (the testbed ``size`` pair of ``family``, default ``base``,
    at ``calibration``, default ``cpu``); a target is a folder or hub id (with ``draft``), a pair name (``calibration``
    inflates it when it names none) or a folder written by ``pipe.save_pretrained`` (its pair, the bench's settings);
    ``calibration`` ``"none"``: as trained (see :func:`.tasks.check_pair` for what is refused);
    ``methods`` ``None``: all; ``budget``: ``"auto"``, an int or ``None`` (each policy's config defaults);
    ``beam_width`` ``None``: dsbd's mean output width; ``threads`` ``None``: torch's default.
    """

    target: str | None = None
    draft: str | None = None
    family: str = "qwen2_vl"
    size: str | None = None
    calibration: str | None = None
    tasks: tuple[str, ...] = TASKS
    methods: str | Sequence[str] | None = None
    n: int = 3
    repeats: int = 3
    seed: int = 0
    max_new_tokens: int = 64
    budget: int | str | None = "auto"
    auto_factor: float = DEFAULT_BUDGET_FACTOR
    prune_ratios: tuple[float, ...] = DEFAULT_PRUNE_RATIOS
    probe_sizes: tuple[int, ...] = PROBE_SIZES
    probe_runs: int = 7
    inputs: str = "auto"
    dtype: str = "float32"
    quantization: str | None = None
    draft_quantization: str | None = None
    out: Path = field(default_factory=lambda: Path("bench_out"))
    json_path: Path | None = None
    plots: bool = True
    threads: int | None = None
    verbose: bool = True
    sampling: bool = False
    dsbd: bool = False
    beam_width: int | None = None
    dsbd_options: dict[str, Any] = field(default_factory=dict)
    edd: str = "auto"
    structured_outputs: dict[str, Any] | None = None

    def validated(self) -> BenchConfig:
        """A copy with names resolved and checked.

        Raises:
            ValueError: an unknown method/task/dtype/input source, or a bad number; the message says what is valid.
        """
        budget = self.budget
        if isinstance(budget, str) and budget != "auto":
            raise ValueError(f"budget={budget!r} is invalid: use a positive integer or 'auto'")
        if isinstance(budget, int) and budget < 1:
            raise ValueError(f"budget={budget} is invalid: use at least 1 draft node")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} is invalid: use an integer >= 1")
        for name in ("n", "repeats", "max_new_tokens", "probe_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: use an integer >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        for name in ("quantization", "draft_quantization"):  # before any model loads
            resolve_quantization_config(getattr(self, name), name)
        if self.inputs not in INPUT_SOURCES:
            raise ValueError(f"unknown input source {self.inputs!r}; valid: {', '.join(INPUT_SOURCES)}")
        check_budget_factor(self.auto_factor, "auto factor")
        for ratio in self.prune_ratios:
            if not 0.0 <= ratio < 1.0:
                raise ValueError(f"prune ratio {ratio} is invalid: use numbers in [0, 1)")
        check_pair(self.target, self.draft, self.size, self.calibration)
        check_output_path(self.out, "--out")
        if self.json_path is not None:
            check_output_path(self.json_path, "--json", folder=False)
        if self.beam_width is not None and not (isinstance(self.beam_width, int) and self.beam_width >= 1):
            raise ValueError(f"beam width={self.beam_width!r} is invalid: use an integer >= 1 or 'auto'")
        try:
            dsbd_policy(self.dsbd_options)
        except (ValueError, TypeError) as err:
            raise ValueError(f"dsbd options {self.dsbd_options!r} are invalid: {err}") from err
        try:
            StructuredOutputs.of(self.structured_outputs)
        except (ValueError, TypeError) as err:
            raise ValueError(f"--structured-outputs: {err}") from err
        methods = resolve_methods(self.methods)
        if self.edd != "auto" and not any(m.startswith(EDD_PREFIX) for m in methods):
            raise ValueError(f"--edd {self.edd!r} is for the edd+<policy> rows, and --methods names none")
        if self.prune_ratios and tuple(self.prune_ratios) != DEFAULT_PRUNE_RATIOS and "sage" not in methods:
            raise ValueError(
                "--prune-ratios sets the pruning ablation, which runs sage, and --methods has no sage"
            )
        return replace(
            self,
            methods=tuple(methods),
            tasks=tuple(check_tasks(self.tasks)),
            probe_sizes=tuple(check_sizes(self.probe_sizes)),
        )


# ---- the run --------------------------------------------------------------------------------------------------
def run_bench(config: BenchConfig, pipe: Any = None) -> dict[str, Any]:
    """Run the bench; the result is what ``bench.json`` holds.

    Args:
        config: the options (validated here).
        pipe: an already loaded :class:`~vlmspec.VLMSpecPipeline` to use instead of loading ``config``'s pair.

    Returns:
        ``{"pair", "device", "settings", "cost_probe", "rows", "ablation", "entropy_autocorr", "tau_vs_length"}``,
        plus ``"sampling_settings"``/``"sampling_rows"`` with ``config.sampling`` and
        ``"dsbd_settings"``/``"dsbd_rows"`` with ``config.dsbd``.
    """
    config = config.validated()
    with torch_threads(config.threads):
        return _run(config, pipe)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch CPU threads (``None``: unchanged); restored afterwards."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run(config: BenchConfig, pipe: Any) -> dict[str, Any]:
    log = progress_log(config.verbose)
    pair = None
    if pipe is None:
        pair, pipe = load_config_pair(config)
    items = load_inputs(config.tasks, config.n, config.seed, config.inputs)
    prepared = {(it.task, it.index): pipe.prepare_inputs(it.image, it.prompt, it.video) for it in items}
    log(
        f"pair {pair.source if pair else 'given'}; {len(items)} inputs ({items[0].source}); device {describe_device(pipe)}"
    )

    probe_on = (prepared[items[0].task, 0], items[0].task, config.probe_sizes, config.probe_runs)
    probe = run_cost_probe(pipe, *probe_on)
    pipe.costs, pipe.budget_factor = probe, config.auto_factor  # every policy is fitted to this probe
    budget, budget_note = choose_budget(config.budget, config.auto_factor, probe)
    log(
        f"cost probe done (c_t(64)/c_t(1) = {probe.target_cost(64) / probe.target_cost(1):.2f}); {budget_note}"
    )
    ratios = config.prune_ratios if "sage" in config.methods else ()
    variants = build_variants(config.methods, config.budget, ratios, probe, config.auto_factor)
    edd_methods = [m for m in config.methods if m.startswith(EDD_PREFIX)]
    edd_probe = None
    if edd_methods:
        edd_pipe, missing = load_edd_pipeline(pipe, pair, config)
        if edd_pipe is not None:
            edd_probe = run_cost_probe(edd_pipe, *probe_on, roofline=probe.roofline)
            # The same target costs as every other row (so the same node budget); the EDD draft's own costs.
            edd_probe = replace(edd_probe, target_s=probe.target_s)
            edd_pipe.costs, edd_pipe.budget_factor = edd_probe, config.auto_factor
            share = edd_share(edd_probe.draft_cost(1), edd_probe.target_cost(1))
            log(f"EDD draft: {edd_pipe.draft.edd_config.target_name or 'given'}; {share}")
        asked = config.edd != "auto" or list(config.methods) != resolve_methods(None)  # not the default rows
        if edd_pipe is not None or asked:
            variants += edd_variants(
                edd_methods, config.budget, edd_probe, config.auto_factor, edd_pipe, missing
            )
        else:
            log(f"no EDD rows: {missing}")

    structure = config.structured_outputs
    references = {
        key: pipe.reference_generate(inputs, config.max_new_tokens, structure)
        for key, inputs in prepared.items()
    }
    records = measure(pipe, variants, items, prepared, config, log)
    entropies = entropy_series(pipe, items, prepared, records)
    rows, ablation = aggregate(records, variants, config.tasks, references, probe)
    result = {
        "pair": describe_pair(pipe, pair, config.dtype),
        "device": describe_device(pipe),
        "settings": settings(config, budget, budget_note, items),
        "cost_probe": probe.to_dict(),
        "edd_cost_probe": edd_probe.to_dict() if edd_probe is not None else None,
        "rows": rows,
        "ablation": ablation,
        "entropy_autocorr": entropy_report(entropies),
        "tau_vs_length": tau_vs_length(acceptance_traces(records, variants), config.max_new_tokens),
    }
    result.update(sampling_sections(pipe, items, config, budget, log))
    return result


def sampling_sections(
    pipe: Any, items: Sequence[TaskInput], config: BenchConfig, budget: int | None, log: Any
) -> dict[str, Any]:
    """The ``--sampling`` and ``--dsbd`` sections' result entries (``{}`` when neither is asked for)."""
    out: dict[str, Any] = {}
    if config.sampling:
        section = run_sampling_section(
            pipe, items, config.methods, budget, config.max_new_tokens, config.repeats, config.seed, log
        )
        out.update(sampling_settings=section["settings"], sampling_rows=section["rows"])
    if config.dsbd:
        section = run_dsbd_section(
            pipe, config.n, config.seed, config.inputs, config.dsbd_options, config.beam_width,
            config.max_new_tokens, config.repeats, log,
        )  # fmt: skip
        out.update(dsbd_settings=section["settings"], dsbd_rows=section["rows"])
    return out


@torch.inference_mode()
def measure(
    pipe: Any,
    variants: Sequence[Variant],
    items: Sequence[TaskInput],
    prepared: dict[tuple[str, int], dict[str, torch.Tensor]],
    config: BenchConfig,
    log: Any,
) -> list[RunRecord]:
    """Warm every variant up on the first input, then run all of them interleaved per input and repeat.

    A variant that failed on an input (e.g. ``hf_assisted`` for a family transformers cannot assist) is not
    retried on that input's later repeats.
    """
    usable = {v.key: v for v in variants if v.error is None}

    def run(key: str, item: TaskInput, repeat: int) -> RunRecord:
        inputs = prepared[item.task, item.index]
        return run_variant(
            pipe, usable[key], item, inputs, config.max_new_tokens, repeat, config.structured_outputs
        )

    return interleaved(items, config.repeats, list(usable), run, log, warm_up=True)


def entropy_series(
    pipe: Any,
    items: Sequence[TaskInput],
    prepared: dict[tuple[str, int], dict[str, torch.Tensor]],
    records: Sequence[RunRecord],
) -> dict[str, list[list[float]]]:
    """The target's per-token entropies along each AR output, per task."""
    ar = {
        (r.task, r.index): r.token_ids for r in records if r.key == AR and r.repeat == 0 and r.error is None
    }
    out: dict[str, list[list[float]]] = {}
    for item in items:
        tokens = ar.get((item.task, item.index))
        if tokens:
            out.setdefault(item.task, []).append(
                token_entropies(pipe.target, prepared[item.task, item.index], tokens)
            )
    return out


def acceptance_traces(
    records: Sequence[RunRecord], variants: Sequence[Variant]
) -> dict[str, list[list[int]]]:
    """Per speculative engine method (ablation variants excluded), the first repeat's per-step acceptances."""
    keys = {v.key for v in variants if not v.ablation and v.policy is not None and v.policy.uses_draft}
    out: dict[str, list[list[int]]] = {}
    for r in records:
        if r.key in keys and r.repeat == 0 and r.error is None:
            out.setdefault(r.key, []).append(r.accepted_per_step)
    return out


# ---- descriptions ---------------------------------------------------------------------------------------------
def describe_device(pipe: Any) -> str:
    """The device the target runs on, in words."""
    device = next(pipe.target.parameters()).device
    if device.type == "cuda":  # and whether SDPA's cuDNN backend runs while decoding (vlmspec.kernels)
        attention = "cuDNN attention on" if pipe.cudnn_attention else "cuDNN attention off"
        return f"cuda ({torch.cuda.get_device_name(device)}, {attention} while decoding)"
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores)"


def describe_pair(pipe: Any, pair: ResolvedPair | None, dtype: str) -> dict[str, Any]:
    def params(model: torch.nn.Module | None) -> float | None:
        if model is None:
            return None
        count = getattr(model, "num_parameters", None)  # transformers' counts packed 4-bit weights whole
        return (count() if count is not None else sum(p.numel() for p in model.parameters())) / 1e6

    return {
        "target": pair.target if pair else getattr(pipe.target, "name_or_path", "?"),
        "draft": pair.draft if pair else getattr(pipe.draft, "name_or_path", "?"),
        "source": pair.source if pair else "given pipeline",
        "family": pipe.target.config.model_type,
        "dtype": str(pipe.target.dtype).replace("torch.", "") if dtype == "auto" else dtype,
        "quantization": {
            role: _method(model) for role, model in (("target", pipe.target), ("draft", pipe.draft))
        },
        "target_params_m": params(pipe.target),
        "draft_params_m": params(pipe.draft),
    }


def _method(model: torch.nn.Module | None) -> str | None:
    """How ``model`` is quantized (its ``quant_method``), ``None`` when it is not."""
    description = quantization_description(model) if model is not None and hasattr(model, "config") else None
    return description.get("quant_method") if description else None


def settings(
    config: BenchConfig, budget: int | None, note: str, items: Sequence[TaskInput]
) -> dict[str, Any]:
    return {
        "tasks": list(config.tasks),
        "methods": list(config.methods),
        "n": config.n,
        "repeats": config.repeats,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "budget": budget,
        "budget_mode": "auto" if config.budget == "auto" else ("default" if budget is None else "fixed"),
        "budget_note": note,
        "auto_factor": config.auto_factor,
        "prune_ratios": list(config.prune_ratios),
        "inputs_source": items[0].source if items else config.inputs,
        "prompts": {f"{it.task}[{it.index}]": it.prompt for it in items},
        "probe_sizes": list(config.probe_sizes),
        "probe_runs": config.probe_runs,
        "threads": torch.get_num_threads(),
        "structured_outputs": config.structured_outputs,
    }


def write_report(
    result: dict[str, Any], out: Path, json_path: Path | None = None, plots: bool = True
) -> dict[str, Path]:
    """Write the markdown/CSV/JSON files (and the plots) of a :func:`run_bench` result; name -> path."""
    paths = write_files(result, Path(out), Path(json_path) if json_path else None)
    if plots:
        from .plots import write_plots

        paths.update(write_plots(result, Path(out)))
    return paths


def progress_log(verbose: bool):
    """A printer of progress lines (``[bench] ...`` on stderr) that ``--quiet`` silences."""

    def log(message: str) -> None:
        if verbose:
            print(f"[bench] {message}", file=sys.stderr, flush=True)

    return log


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of parsed :func:`add_arguments` options."""
    names = {f.name for f in fields(BenchConfig)} & set(vars(args))
    return BenchConfig(
        **{name: getattr(args, name) for name in names},
        json_path=args.json,
        plots=not args.no_plots,
        verbose=not args.quiet,
    )


def run_args(args: argparse.Namespace, defaults: argparse.Namespace | None = None) -> int:
    """Run the bench from parsed arguments (for a CLI that parsed them with :func:`add_arguments`; ``defaults``: what
    that CLI's parser gives when no flag is given, where it sets its own); a bad option prints one line and returns 1,
    as every ``vlmspec`` command does."""
    try:
        config = config_from_args(args).validated()
        check_section_flags(args, defaults)
    except ValueError as err:
        print(f"vlmspec bench: error: {err}", file=sys.stderr)
        return 1
    if args.throughput:
        from . import throughput

        return throughput.run_section(config, args.throughput, args.throughput_policies)
    if args.conversation:
        from . import conversation

        return conversation.run_section(config, args.throughput_policies)
    result = run_bench(config)
    paths = write_report(result, config.out, config.json_path, config.plots)
    print(markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


_BENCH_ONLY_FLAGS = (
    "--json", "--methods", "--sampling", "--dsbd", "--tasks", "--repeats", "--budget", "--auto-factor",
    "--prune-ratios", "--probe-sizes", "--probe-runs", "--no-plots", "--beam-width", "--dsbd-options", "--inputs",
)  # fmt: skip
"""The bench's flags that the ``--throughput`` and ``--conversation`` sections do not honour (they decode each
input once with the pipeline's own budget and pruning, and write no JSON, plots or probe)."""


_COMPANIONS = {
    "--beam-width": "--dsbd",
    "--dsbd-options": "--dsbd",
    "--throughput-policies": "--throughput or --conversation",
    "--auto-factor": "--budget auto",
}
"""Flags that act only beside another one."""


def _given(args: argparse.Namespace, defaults: argparse.Namespace, flag: str) -> bool:
    name = flag.removeprefix("--").replace("-", "_")
    return getattr(args, name) != getattr(defaults, name)


def check_section_flags(args: argparse.Namespace, defaults: argparse.Namespace | None = None) -> None:
    """Refuse a flag given without the one it acts beside (:data:`_COMPANIONS`), and with ``--throughput`` or
    ``--conversation`` (each runs instead of the bench and writes its own ``<out>/<section>.md``) the flags of the
    bench that section does not honour. A flag counts as given when its value is not the parser's default
    (``defaults``; ``None``: the bench's own).

    Raises:
        ValueError: naming the section and the flags.
    """
    section = "--throughput" if args.throughput else "--conversation" if args.conversation else None
    defaults = defaults or add_arguments(argparse.ArgumentParser()).parse_args([])
    given = {"--dsbd": args.dsbd, "--throughput or --conversation": section is not None,
             "--budget auto": args.budget == "auto"}  # fmt: skip
    lonely = [f"{flag} (needs {need})" for flag, need in _COMPANIONS.items() if _given(args, defaults, flag)
              and not given[need]]  # fmt: skip
    if lonely:
        raise ValueError(
            f"{', '.join(lonely)}: a flag that acts only beside another one, which was not given"
        )
    if section is None:
        return
    check_section_policies(args.throughput_policies)
    refused = [flag for flag in _BENCH_ONLY_FLAGS if _given(args, defaults, flag)]
    if section == "--throughput" and args.conversation:
        refused.insert(0, "--conversation")
    if refused:
        name = section.removeprefix("--")
        raise ValueError(
            f"{section} runs the {name} section instead of the bench: it writes {name}.md only, for the methods "
            f"of --throughput-policies, and does not honour {', '.join(refused)}; run those separately"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vlmspec_eval.bench [options]``: ``vlmspec bench``, through the command line's one boundary (a bad
    option, flag or pair prints one line and returns 1; ``--debug`` shows the traceback)."""
    from vlmspec.cli import main as vlmspec_main

    return vlmspec_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
