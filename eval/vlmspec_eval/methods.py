"""The methods the bench compares, their node budgets, and one timed run of a method on one input.

Methods: ``hf_generate`` (transformers' own greedy ``generate()`` on the target: what users run today, the
speed-up baseline), ``ar`` (the engine's plain decoding, the identity baseline), ``hf_assisted`` (transformers'
own assisted generation with the same draft) and every registered tree policy but ``ar`` (new policies appear
automatically).

Node budgets: every policy config names its node-budget and depth fields (``PolicyConfig.budget_field`` /
``depth_field``), so one rule serves every policy, new ones included. ``--budget auto`` (the default) is what a
pipeline does: the options a user leaves out are fitted to the bench's cost probe (``pipe.costs``); ``N`` sets
every policy's node budget to ``N`` (depths still fitted); ``default`` runs each policy's config defaults as given.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmspec.costs import DEFAULT_BUDGET_FACTOR, ForwardCosts
from vlmspec.models import ASSISTANT_TYPES, TEXT_DRAFT_TYPES, EDDDraft
from vlmspec.policies import TreePolicy, available_policies, check_greedy, get_policy, policy_class
from vlmspec.probe import sync

AR = "ar"
HF_GENERATE = "hf_generate"
HF_ASSISTED = "hf_assisted"
TRANSFORMERS_METHODS: tuple[str, ...] = (HF_GENERATE, HF_ASSISTED)
"""Methods run by transformers' ``generate()`` rather than the engine."""

AUTO = "auto"

EDD_PREFIX = "edd+"
"""``edd+<policy>``: the policy with an EDD draft (:mod:`vlmspec.models.edd`) instead of the pair's draft model."""
DEFAULT_EDD_METHODS: tuple[str, ...] = ("edd+pct", "edd+sage")
"""Run by default when the pair has an EDD draft: the paper's pairing (EDD + PCT) and the default policy."""

RECOVERABLE_POLICY_ERRORS = (NotImplementedError, ValueError, RuntimeError)
"""What a policy run may raise without stopping the bench (the row reports it); ``ar`` errors always stop it."""


# ---- method names --------------------------------------------------------------------------------------------
def valid_methods() -> list[str]:
    """``ar``, ``hf_generate``, ``hf_assisted`` and every registered policy except ``ar``."""
    return [AR, HF_GENERATE, HF_ASSISTED, *(p for p in available_policies() if p != AR)]


def resolve_methods(spec: str | Sequence[str] | None) -> list[str]:
    """Method names to run, ``ar`` and ``hf_generate`` first (always run: the baselines of identity and speed-up).

    Args:
        spec: comma-separated names or a list; ``None``/``"all"`` means :func:`valid_methods` less the policies
            that are not lossless with their default config (``dsbd``: beam sampling, measured by ``--dsbd``).

    Raises:
        ValueError: an unknown name (the message lists the valid methods), or a policy with no greedy form (dsbd:
            the message points to ``--dsbd``).
    """
    valid = valid_methods()
    if spec is None or spec == "all":
        lossless = [m for m in valid if m in (AR, *TRANSFORMERS_METHODS) or get_policy(m).lossless]
        return [*lossless, *DEFAULT_EDD_METHODS]
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    bad = [n for n in names if n not in valid and not _is_edd_method(n)]
    if bad or not names:
        raise ValueError(f"unknown method(s) {bad or '(none given)'}; valid methods: {', '.join(valid)}")
    for name in names:
        if name.removeprefix(EDD_PREFIX) in available_policies():
            greedy = f"--methods {name}: the methods' rows decode greedily (each checked against generate())"
            check_greedy(get_policy(name.removeprefix(EDD_PREFIX)), greedy, "bench it with --dsbd")
    return list(dict.fromkeys([AR, HF_GENERATE, *names]))


def check_section_policies(names: Sequence[str]) -> None:
    """``--throughput-policies``: registered policies or ``edd+<policy>``, checked before any model loads.

    Raises:
        ValueError: naming the unknown ones and the valid names.
    """
    bad = [n for n in names if n not in available_policies() and not _is_edd_method(n)]
    if bad or not names:
        valid = ", ".join(available_policies())
        raise ValueError(
            f"unknown --throughput-policies {bad or '(none given)'}; valid: {valid}, or edd+<policy> for the EDD draft"
        )
    lossy = [n for n in names if not get_policy(n.removeprefix(EDD_PREFIX)).lossless]
    if lossy:
        raise ValueError(
            f"--throughput-policies {lossy}: the sections decode greedily and check every caption against "
            "generate()'s, so they take lossless policies only"
        )


def _is_edd_method(name: str) -> bool:
    policy = name.removeprefix(EDD_PREFIX)
    return name.startswith(EDD_PREFIX) and policy in available_policies() and policy != AR


# ---- budgets ----------------------------------------------------------------------------------------------------
def make_policy(
    name: str,
    budget: int | str | None,
    costs: ForwardCosts | None = None,
    factor: float = DEFAULT_BUDGET_FACTOR,
) -> TreePolicy:
    """Policy ``name`` with a node budget: ``"auto"`` (options left out, fitted to ``costs`` when given, as a pipeline
    does), an int (the node budget, via ``PolicyConfig.budget_options``) or ``None`` (the config's defaults, as given).
    """
    cls = policy_class(name)
    if budget is None:
        return cls(cls.config_class())
    if budget == AUTO:
        policy = get_policy(name)
    else:
        policy = get_policy(name, **cls.config_class().budget_options(nodes=int(budget)))
    if costs is not None:
        policy.fit(costs, factor)
    return policy


# ---- variants -------------------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One thing the bench runs on every input.

    Attributes:
        key: unique label (``"sage"``, or ``"sage@prune=0.5"`` for the prune-ratio ablation).
        method: method name (``edd+<policy>`` for the EDD rows).
        policy: the policy instance (``None`` for ``hf_generate`` and ``hf_assisted``).
        budget: node budget it runs with (``None``: not applicable).
        prune_ratio: the draft's visual pruning ratio (``None``: the pipeline's defaults).
        ablation: True for the prune-ratio ablation variants (reported in their own table).
        error: why the variant could not be built (its rows report it and it is not run), else ``None``.
        pipe: the pipeline it runs on when not the bench's own (the EDD rows: the same target, an EDD draft).
    """

    key: str
    method: str
    policy: TreePolicy | None
    budget: int | None
    prune_ratio: float | None = None
    ablation: bool = False
    error: str | None = None
    pipe: Any = None


def edd_variants(
    methods: Sequence[str],
    budget: int | str | None,
    costs: ForwardCosts | None,
    factor: float,
    edd_pipe: Any,
    missing: str,
) -> list[Variant]:
    """The ``edd+<policy>`` variants, run on ``edd_pipe`` with budgets fitted to its own ``costs``; with no EDD
    pipeline each is an error row saying ``missing``."""
    variants = []
    for method in methods:
        if edd_pipe is None:
            variants.append(Variant(key=method, method=method, policy=None, budget=None, error=missing))
        else:
            variants.append(
                dataclasses.replace(_policy_variant(method, method, budget, costs, factor), pipe=edd_pipe)
            )
    return variants


def build_variants(
    methods: Sequence[str],
    budget: int | str | None,
    prune_ratios: Sequence[float] = (),
    costs: ForwardCosts | None = None,
    factor: float = DEFAULT_BUDGET_FACTOR,
) -> list[Variant]:
    """The variants for ``methods`` (budget applied, see :func:`make_policy`) plus ``sage`` at each ablation prune
    ratio (if sage exists).

    A policy that cannot be built (a missing asset, a budget its config rejects) becomes a variant with
    ``error`` set instead of stopping the bench; ``ar`` must build.
    """
    variants = []
    for method in methods:
        if method.startswith(EDD_PREFIX):  # see edd_variants
            continue
        if method in TRANSFORMERS_METHODS:
            variants.append(Variant(key=method, method=method, policy=None, budget=None))
        else:
            variants.append(_policy_variant(method, method, budget, costs, factor))
    if "sage" in available_policies():
        for ratio in prune_ratios:
            variant = _policy_variant(f"sage@prune={ratio:g}", "sage", budget, costs, factor)
            variants.append(dataclasses.replace(variant, prune_ratio=float(ratio), ablation=True))
    return variants


def _policy_variant(
    key: str, method: str, budget: int | str | None, costs: ForwardCosts | None, factor: float
) -> Variant:
    try:
        policy = make_policy(method.removeprefix(EDD_PREFIX), budget, costs, factor)
    except (*RECOVERABLE_POLICY_ERRORS, OSError, TypeError) as err:
        if method == AR:
            raise
        return Variant(
            key=key,
            method=method,
            policy=None,
            budget=budget if isinstance(budget, int) else None,
            error=f"{type(err).__name__}: {err}",
        )
    return Variant(key=key, method=method, policy=policy, budget=policy.config.node_budget)


# ---- forward timers -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardCall:
    """One forward of the target or the draft (:class:`ForwardRecorder`).

    Attributes:
        role: ``"target"`` or ``"draft"``.
        tokens: new tokens fed.
        seconds: wall time of the call.
        prefill: True when the model's cache was empty (a prompt prefill).
    """

    role: str
    tokens: int
    seconds: float
    prefill: bool


class ForwardRecorder:
    """Times every forward of the target and the draft: each model's top-level ``forward`` (forward pre/post hooks)
    and each adapter's ``run``, whichever a call enters first (a call inside another is part of it).

    The engine's tree forwards end in ``adapter.run``, which calls the model's ``forward`` for most families and
    runs the decoder written out for the families with recurrent layers (:mod:`vlmspec.models.hybrid`); a Gemma 4
    assistant's drafts call its inner model (hooked); its unpruned prefills and transformers' ``generate`` call the
    model's ``forward``; pruned/scored prefills run the
    decoder directly and are not seen (the engine's ``prefill_seconds`` cover them). On CUDA each call synchronises
    so times are real.

    Args:
        target, draft: the models.
        adapters: the pipeline's adapters by role (``"target"``, ``"draft"``; a pipeline's ``target_adapter`` and
            ``draft_adapter``), whose ``run`` is timed too; none by default.
    """

    def __init__(
        self, target: torch.nn.Module, draft: torch.nn.Module | None, adapters: dict[str, Any] | None = None
    ) -> None:
        self.calls: list[ForwardCall] = []
        if draft is not None and draft.config.model_type in ASSISTANT_TYPES:
            draft = (
                draft.model
            )  # vlmspec runs a Gemma 4 assistant's inner model (its own masks), as its forward does
        self._models = [("target", target)] + ([("draft", draft)] if draft is not None else [])
        self._adapters = [(role, a) for role, a in (adapters or {}).items() if a is not None]
        self._open: dict[str, tuple[int, bool, float]] = {}
        self._depth: dict[str, int] = {}

    @contextmanager
    def recording(self) -> Iterator[ForwardRecorder]:
        """Record calls inside the ``with`` block (hooks and timed ``run`` methods are removed afterwards, also when
        a forward raises: a failed call ends there)."""
        self._open.clear()
        self._depth.clear()
        with ExitStack() as undo:
            for role, model in self._models:
                undo.callback(model.register_forward_pre_hook(self._pre(role), with_kwargs=True).remove)
                undo.callback(model.register_forward_hook(self._post(role), always_call=True).remove)
            for role, adapter in self._adapters:
                timed = self._timed(role, adapter.run)
                adapter.run = timed  # an instance attribute over the class's method
                undo.callback(_unset_run, adapter, timed)
            yield self

    def _enter(self, role: str, tokens: int, cache: Any, device_of: torch.nn.Module) -> None:
        depth = self._depth.get(role, 0)
        self._depth[role] = depth + 1
        if depth == 0:
            prefill = cache is not None and cache.get_seq_length() == 0  # no cache: a drafter that keeps none
            _sync(device_of)
            self._open[role] = (tokens, prefill, time.perf_counter())

    def _exit(self, role: str, device_of: torch.nn.Module) -> None:
        self._depth[role] -= 1
        if self._depth[role] == 0:
            _sync(device_of)
            tokens, prefill, start = self._open.pop(role)
            self.calls.append(ForwardCall(role, tokens, time.perf_counter() - start, prefill))

    def _pre(self, role: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            tokens = (
                ids.shape[:2].numel() if ids is not None else 0
            )  # rows x tokens (a multi-token drafter's nodes)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers >= 5.24: `cache`
            self._enter(role, tokens, cache, module)

        return hook

    def _post(self, role: str):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            self._exit(role, module)

        return hook

    def _timed(self, role: str, run: Callable[..., Any]) -> Callable[..., Any]:
        model = run.__self__.model

        def timed_run(cache: Any, rows: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._enter(role, rows.shape[:2].numel(), cache, model)  # rows: [B, n, D]
            try:
                return run(cache, rows, *args, **kwargs)
            finally:
                self._exit(role, model)

        return timed_run


def _unset_run(adapter: Any, timed: Callable[..., Any]) -> None:
    """Remove the timed ``run`` put on ``adapter`` (not another one put over it since)."""
    if vars(adapter).get("run") is timed:
        del adapter.run


def _sync(module: torch.nn.Module) -> None:
    param = next(module.parameters(), None)
    if param is not None:
        sync(param.device)


# ---- one run --------------------------------------------------------------------------------------------------
@dataclass
class RunRecord:
    """One timed generation of one variant on one input.

    Attributes:
        key, method, task, index, repeat: what ran where.
        token_ids: generated ids.
        total_s: wall time of the generation (inputs already processed).
        steps: target forwards after the prefill (``hf_assisted``: every target forward, see ``emits_on_prefill``).
        accepted_per_step: accepted draft tokens per step (engine runs; empty for ``hf_assisted``).
        tree_sizes: draft nodes verified per step.
        phases: engine phase times in seconds (``prefill``, ``draft_prefill``, ``draft``, ``verify``); ``{}`` for HF.
        calls: the recorded model forwards.
        emits_on_prefill: True when the target prefill also verified draft tokens (``hf_assisted``), so tokens
            per step counts every target forward; False for the engine (its prefill emits exactly one token).
        draft_visual_tokens, target_visual_tokens: visual tokens in the draft's / target's prefill.
        error: ``None``, or why the run failed (then the other fields are empty).
    """

    key: str
    method: str
    task: str
    index: int
    repeat: int
    token_ids: list[int] = field(default_factory=list)
    total_s: float = 0.0
    steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    calls: list[ForwardCall] = field(default_factory=list)
    emits_on_prefill: bool = False
    draft_visual_tokens: int | None = None
    target_visual_tokens: int | None = None
    error: str | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.total_s, 1e-9)

    @property
    def decoded_tokens(self) -> int:
        """Tokens emitted by the counted ``steps``."""
        return self.new_tokens if self.emits_on_prefill else max(self.new_tokens - 1, 0)

    @property
    def accepted(self) -> int:
        """Accepted draft tokens over all steps (``hf_assisted``: tokens emitted beyond one per target forward)."""
        if self.accepted_per_step:
            return sum(self.accepted_per_step)
        return max(self.decoded_tokens - self.steps, 0)

    @property
    def tokens_per_step(self) -> float:
        return self.decoded_tokens / max(self.steps, 1)


def run_variant(
    pipe: Any,
    variant: Variant,
    item: Any,
    inputs: dict[str, torch.Tensor],
    max_new_tokens: int,
    repeat: int,
    structure: dict[str, Any] | None = None,
) -> RunRecord:
    """Run ``variant`` once on ``item`` (a :class:`~vlmspec_eval.tasks.TaskInput`) and time it.

    Args:
        pipe: the :class:`~vlmspec.VLMSpecPipeline`.
        variant: what to run.
        item: the input (image/video/prompt).
        inputs: ``pipe.prepare_inputs`` of ``item`` (used by ``hf_assisted``).
        max_new_tokens: generation length.
        repeat: repeat index (recorded).
        structure: the ``structured_outputs`` every reply follows (``None``: none).
    """
    record = RunRecord(
        key=variant.key, method=variant.method, task=item.task, index=item.index, repeat=repeat
    )
    pipe = variant.pipe or pipe
    adapters = {"target": pipe.target_adapter, "draft": pipe.draft_adapter}
    recorder = ForwardRecorder(pipe.target, pipe.draft, adapters)
    if variant.method in TRANSFORMERS_METHODS:
        _run_transformers(pipe, variant.method, inputs, max_new_tokens, record, recorder, structure)
    else:
        _run_engine(pipe, variant, item, max_new_tokens, record, recorder, structure)
    record.calls = recorder.calls
    return record


def _run_engine(
    pipe: Any,
    variant: Variant,
    item: Any,
    max_new_tokens: int,
    record: RunRecord,
    recorder: ForwardRecorder,
    structure: dict[str, Any] | None,
) -> None:
    with recorder.recording():
        out, record.error = generate_with(
            pipe, variant.policy, item, variant.method == AR, max_new_tokens=max_new_tokens,
            prune_ratio=variant.prune_ratio, structured_outputs=structure,
        )  # fmt: skip
    if out is None:
        return
    stats = out.stats
    record.token_ids = list(out.token_ids)
    record.total_s = stats.total_seconds
    record.steps = stats.steps
    record.tree_sizes = list(stats.tree_sizes)
    record.accepted_per_step = [int(t.get("accepted", 0)) for t in stats.trace]
    record.phases = {
        "prefill": stats.prefill_seconds,
        "draft_prefill": stats.draft_prefill_seconds,
        "draft": stats.draft_seconds,
        "verify": stats.verify_seconds,
    }
    record.draft_visual_tokens = stats.draft_visual_tokens if variant.policy.uses_draft else None
    record.target_visual_tokens = stats.target_visual_tokens


def generate_with(
    pipe: Any, policy: TreePolicy, item: Any, baseline: bool, **options: Any
) -> tuple[Any, str | None]:
    """``(pipe(item, **options) with policy, None)``, or ``(None, why)`` when the policy raised one of
    :data:`RECOVERABLE_POLICY_ERRORS` (raised instead for the ``baseline``)."""
    pipe.policy = policy
    try:
        return pipe(item.image, item.prompt, video=item.video, **options), None
    except RECOVERABLE_POLICY_ERRORS as err:
        if baseline:
            raise
        return None, f"{type(err).__name__}: {err}"


def assisted_generate(pipe: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> list[int]:
    """transformers' assisted generation with the pipeline's draft; the new token ids.

    Raises:
        TypeError: the draft is an EDD draft (a layer reading the target's hidden states), which transformers'
            assisted generation cannot run: it takes a whole model as the assistant; or a language model, to
            which it would give the target's processor outputs.
    """
    if isinstance(pipe.draft, EDDDraft):
        raise TypeError(
            "hf_assisted needs a separate draft model; an EDD draft reads the target's hidden states"
        )
    if pipe.draft.config.model_type in TEXT_DRAFT_TYPES:
        raise TypeError(
            "hf_assisted gives the assistant the target's inputs, pictures included, which a language-model "
            "draft does not take"
        )
    out = pipe.target.generate(
        **inputs, assistant_model=pipe.draft, do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _run_transformers(
    pipe: Any,
    method: str,
    inputs: dict[str, torch.Tensor],
    max_new_tokens: int,
    record: RunRecord,
    recorder: ForwardRecorder,
    structure: dict[str, Any] | None = None,
) -> None:
    """``hf_generate`` (the target's own greedy ``generate()``, with xgrammar's processor under a ``structure``)
    or ``hf_assisted`` (none with a structure: xgrammar's processor takes one token per call), timed."""
    with recorder.recording():
        start = time.perf_counter()
        try:
            if method == HF_ASSISTED and structure is not None:
                raise TypeError(
                    "hf_assisted has no structured outputs: xgrammar's processor takes a token per call"
                )
            if method == HF_ASSISTED:
                tokens = assisted_generate(pipe, inputs, max_new_tokens)
            else:
                tokens = pipe.reference_generate(inputs, max_new_tokens, structure)
        except Exception as err:  # transformers may fail in any way for a family; the row records how
            record.error = f"{type(err).__name__}: {err}".strip()
            return
        record.total_s = time.perf_counter() - start
    record.token_ids = tokens
    record.emits_on_prefill = method == HF_ASSISTED
    target_calls = [
        c for c in recorder.calls if c.role == "target" and (method == HF_ASSISTED or not c.prefill)
    ]
    record.steps = len(target_calls)
    record.tree_sizes = [c.tokens - 1 for c in target_calls if not c.prefill]


def interleaved(
    items: Sequence[Any],
    repeats: int,
    keys: Sequence[str],
    run_one: Callable[[str, Any, int], Any],
    log: Any,
    label: str = "",
    warm_up: bool = False,
) -> list[Any]:
    """``run_one(key, item, repeat)`` for every input, repeat and key, the keys in turn (their order rotated per
    repeat, so machine noise hits all alike); a key whose run failed on an input (``run.error``) is not retried on
    that input's later repeats. One log line per input and repeat with each run's tokens/s. With ``warm_up``, every
    key first runs once untimed on the first input (``repeat=-1``, its result dropped)."""
    for key in keys if warm_up else ():
        run_one(key, items[0], -1)
    runs: list[Any] = []
    failed: set[tuple[str, str, int]] = set()
    for item in items:
        for repeat in range(repeats):
            shift = repeat % max(len(keys), 1)
            line = []
            for key in [*keys[shift:], *keys[:shift]]:
                if (key, item.task, item.index) in failed:
                    continue
                run = run_one(key, item, repeat)
                runs.append(run)
                if run.error is not None:
                    failed.add((key, item.task, item.index))
                line.append(f"{key} {'ERR' if run.error else f'{run.tokens_per_s:.1f}'}")
            log(f"{label}{item.task}[{item.index}] repeat {repeat + 1}/{repeats} tok/s: {', '.join(line)}")
    return runs
