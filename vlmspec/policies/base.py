"""The policy contract and registry.

A *tree policy* decides the shape of each step's draft tree. It has one required method, ``build_tree``, which
grows a tree through a :class:`~vlmspec.draft.DraftTree` (batched draft forwards, one per level) and returns it
as a :class:`~vlmspec.tree.TokenTree`, and one optional hook, ``feedback``, which receives the verification
outcome of the step. Per-request state (if any) is cleared by ``reset``. Policies are registered by name::

    @register_policy("chain")
    class ChainPolicy(TreePolicy):
        config_class = ChainConfig
        ...

    policy = get_policy("chain", gamma=4)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, ClassVar, TypeVar

import torch

from ..costs import DEFAULT_ACCEPTANCE, DEFAULT_BUDGET_FACTOR, ForwardCosts
from ..draft import DraftTree
from ..errors import (
    InputTypeError,
    InvalidInputError,
    SlowSpeculationWarning,
    user_stacklevel,
)
from ..sampling import Sampler
from ..tree import TokenTree
from ..validation import check_field_types
from ..verify import Acceptance, greedy_accept, sample_accept
from .files import file_options

Paths = tuple[tuple[int, ...], ...]

MAX_RANK = 1 << 20
"""Ranks in rank paths are below it (1,048,576): a rank is a position in the draft's sorted vocabulary, and no
vocabulary is that large. The pair's own vocabulary bounds them again when the policy is attached
(:meth:`PolicyConfig.check_vocabulary`)."""


@dataclass(frozen=True)
class PolicyConfig:
    """Base of every policy's frozen config. Subclasses validate fields in ``__post_init__``.

    **One node budget.** A policy whose trees have a size bound names the field holding it in
    :attr:`budget_field` (SAGE's ``n_max``, EAGLE-2's ``total_tokens``, WETAP's ``budget``, PCT's ``max_nodes``,
    the static tree's ``paths``), and the field bounding its depth in :attr:`depth_field`. Everything that sets a
    budget goes through :attr:`node_budget` and :meth:`with_budget` (the paper's own names stay the options users
    write), so the hardware-aware budgets of :meth:`TreePolicy.fit` and the bench's ``--budget`` treat every
    policy alike.
    """

    budget_field: ClassVar[str | None] = None
    """The field bounding the tree's draft nodes (an int, or rank paths truncated to the budget), or ``None``."""
    depth_field: ClassVar[str | None] = None
    """The field bounding the tree's depth, or ``None``."""
    rank_fields: ClassVar[tuple[str, ...]] = ()
    """The fields holding rank paths (the static tree's ``paths``, SAGE's ``initial_paths``), whose ranks must be
    below the pair's vocabulary (:meth:`check_vocabulary`)."""
    file_fields: ClassVar[tuple[str, ...]] = ()
    """The fields holding the path of a file the policy reads (C2T's ``classifier``): a saved pipeline copies the
    file, with its :meth:`companion_files`, into its folder and records it relative to the folder
    (:mod:`vlmspec.saving`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every config checks its fields' types (:meth:`_check_types`) before its own ``__post_init__``."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None:

            def post_init(self: PolicyConfig) -> None:
                self._check_types()
                own(self)

            cls.__post_init__ = post_init  # type: ignore[method-assign]

    def __post_init__(self) -> None:
        self._check_types()

    def _check_types(self) -> None:
        """:func:`~vlmspec.validation.check_field_types`, and every number finite: NaN passes no range check and an
        infinity passes every bound (SAGE's ``theta_scale=inf`` would keep no candidate, silently plain decoding).
        A :attr:`file_fields` value given as a ``pathlib.Path`` is first made the text it stands for (a file
        option is declared, saved and compared as text)."""
        for field in self.file_fields:
            if isinstance(getattr(self, field), PurePath):
                object.__setattr__(self, field, str(getattr(self, field)))
        check_field_types(self)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            check(
                not isinstance(value, float) or math.isfinite(value),
                self,
                field.name,
                value,
                "a finite number",
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PolicyConfig:
        """Build from a mapping of the user's options; unknown keys are an error that lists the valid ones.

        The options it leaves out take their defaults as :meth:`implied_options` fits them around the given ones,
        so that every path from options to a config (``get_policy``, a YAML file, ``--policy-options``, lmms-eval's
        ``--model_args``, a saved pipeline) validates the same merged config.
        """
        cls.check_names(values)
        implied = cls.implied_options(values)
        return cls(**{**{k: v for k, v in implied.items() if k not in values}, **values})

    @classmethod
    def check_names(cls, names: Collection[Any]) -> None:
        """Refuse option names this config does not have (a typo, a YAML key such as ``1:`` or ``null:``), listing
        the valid ones."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted((n for n in names if n not in valid), key=repr)
        if unknown:
            raise InvalidInputError(
                f"{cls.__name__}: unknown option(s) {unknown}; valid options are {sorted(valid) or 'none'}"
            )

    @classmethod
    def implied_options(cls, values: dict[str, Any]) -> dict[str, Any]:
        """What the user's options ``values`` imply for the options they leave out, as :meth:`TreePolicy.fit`
        fits a budget or depth around the options set: a node budget or depth set applied to the defaults of the
        rest (:meth:`budget_options`: SAGE's default ``d_min`` lowered to a smaller ``d_max`` set, so that
        ``get_policy("sage", d_max=4)`` is SAGE with depths up to 4, not a refusal of the default ``d_min``).
        Subclasses add the converse (a set option that moves a budget or depth default). Values the configs'
        own checks refuse imply nothing: the check names them."""
        budget, depth = (
            values.get(f) if f is not None else None for f in (cls.budget_field, cls.depth_field)
        )
        nodes = budget if is_int(budget) and budget >= 1 else None
        depth = depth if is_int(depth) and depth >= 1 else None
        if nodes is None and depth is None:
            return {}
        base = cls.from_dict(
            {k: v for k, v in values.items() if k not in (cls.budget_field, cls.depth_field)}
        )
        return base.budget_options(nodes, depth, fixed=set(values))

    @classmethod
    def from_yaml(cls, path: str | Path) -> PolicyConfig:
        """Load from a YAML file (``yaml.safe_load``); a top-level ``policy:`` key, if present, must name the
        policy this config class is registered with (``SAGEPaperConfig``: ``sage_paper``)."""
        return cls.from_dict(cls.yaml_options(path))

    @classmethod
    def yaml_options(cls, path: str | Path, policy: str | None = None) -> dict[str, Any]:
        """The options a YAML file of ``option: value`` lines sets (``yaml.safe_load``; ``policy:`` left out).

        A ``policy:`` key, if present, must be ``policy`` (``None``: a policy registered with this config class),
        so that a file of one policy's options does not load silently as another's.
        """
        names = [policy] if policy is not None else registered_names(cls)
        return file_options(path, names)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def companion_files(cls, field: str, path: Path) -> tuple[Path, ...]:
        """The files, next to ``path`` (in the same folder), that the file of :attr:`file_fields` entry ``field``
        needs in order to load; none by default."""
        return ()

    @property
    def node_budget(self) -> int | None:
        """The most draft nodes a tree may have (``None``: no bound)."""
        if self.budget_field is None:
            return None
        value = getattr(self, self.budget_field)
        return len(value) if isinstance(value, tuple) else value

    def budget_options(
        self, nodes: int | None = None, depth: int | None = None, fixed: Collection[str] = ()
    ) -> dict[str, Any]:
        """The options that give this config a node budget of ``nodes`` and a depth of ``depth`` (``None``: keep).

        An int field is set; a rank-path field keeps its first ``nodes`` paths that stay closed under prefixes.
        Subclasses extend it to keep their other fields consistent (e.g. SAGE's ``d_min <= d_max``), changing only
        fields not in ``fixed`` (the options the user set, :attr:`TreePolicy.fixed`): the budget and depth are
        fitted around those instead (SAGE's depth at least a ``d_min`` the user set).
        """
        for name, value in (("nodes", nodes), ("depth", depth)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidInputError(
                    f"{type(self).__name__}: {name}={value!r} is invalid: use an integer >= 1"
                )
        options: dict[str, Any] = {}
        if nodes is not None and self.budget_field is not None:
            current = getattr(self, self.budget_field)
            options[self.budget_field] = (
                truncate_paths(current, nodes) if isinstance(current, tuple) else nodes
            )
        if depth is not None and self.depth_field is not None:
            options[self.depth_field] = depth
        return options

    def check_vocabulary(self, size: int) -> None:
        """Refuse a rank path whose rank is ``size`` or more: the draft ranks only the ``size`` tokens of its
        vocabulary (the pipeline calls it when the policy is attached).

        Raises:
            InvalidInputError: naming the option, the path, its rank and the vocabulary's size.
        """
        for field in self.rank_fields:
            for path in getattr(self, field):
                if max(path) >= size:
                    raise InvalidInputError(
                        f"{type(self).__name__}.{field} holds the path {list(path)}, whose rank {max(path)} is "
                        f"beyond this pair's vocabulary of {size} tokens: use ranks below {size}"
                    )

    def with_budget(
        self, nodes: int | None = None, depth: int | None = None, fixed: Collection[str] = ()
    ) -> PolicyConfig:
        """A copy with :meth:`budget_options` applied."""
        return dataclasses.replace(self, **self.budget_options(nodes, depth, fixed))


def truncate_paths(paths: Sequence[Sequence[int]], budget: int) -> Paths:
    """The first ``budget`` rank paths, dropping any whose prefix did not make it (so the tree stays closed)."""
    kept: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if len(kept) >= budget:
            break
        path = tuple(int(r) for r in path)
        if len(path) == 1 or path[:-1] in seen:
            kept.append(path)
            seen.add(path)
    return tuple(kept)


def rank_paths(config: object, field: str) -> Paths:
    """The field's rank paths as tuples of ints, refused by name unless they form a tree: each path a non-empty list
    of integers >= 0, every prefix also a path, no path twice."""
    paths: list[tuple[int, ...]] = []
    for path in getattr(config, field):
        ok = isinstance(path, (list, tuple)) and all(
            isinstance(r, int) and not isinstance(r, bool) for r in path
        )
        check(ok and len(path) > 0 and min(path) >= 0, config, field, path,
              "each path is a non-empty list of ranks (integers >= 0)")  # fmt: skip
        check(max(path) < MAX_RANK, config, field, path, f"ranks below {MAX_RANK} (a rank is a position in the "
              "draft's sorted vocabulary; the pair's vocabulary bounds it when the policy is attached)")  # fmt: skip
        paths.append(tuple(path))
    known = set(paths)
    for p in paths:
        check(len(p) == 1 or p[:-1] in known, config, field, p, f"its prefix {p[:-1]} must also be a path")
    check(len(known) == len(paths), config, field, "duplicates", "every path once")
    return tuple(paths)


def check(condition: bool, config: object, field: str, value: object, need: str) -> None:
    """Raise an :class:`~vlmspec.errors.InvalidInputError` naming the config, the bad field, its value and what is
    expected."""
    if not condition:
        raise InvalidInputError(f"{type(config).__name__}.{field}={value!r} is invalid: {need}")


def is_int(value: object) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(config: object, field: str) -> None:
    """:func:`check` that ``config.<field>`` is an integer >= 1."""
    value = getattr(config, field)
    check(is_int(value) and value >= 1, config, field, value, "an integer >= 1")


@dataclass(frozen=True)
class StepFeedback:
    """What the engine tells a policy after each verification.

    Attributes:
        step: 0-based index of the decoding step.
        accepted: draft tokens accepted in this step (tau of the step, bonus token excluded).
        tree_size: draft nodes verified (root excluded).
    """

    step: int
    accepted: int
    tree_size: int


class TreePolicy:
    """Base class of all tree policies."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[PolicyConfig]] = PolicyConfig
    uses_draft: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig | None = None, fixed: Collection[str] | None = None) -> None:
        """
        Args:
            config: the policy's config (``None``: the defaults).
            fixed: the options the user set, which :meth:`fit` leaves alone; ``None``: none when ``config`` is
                ``None``, every option when a config object is given (it is used as given).
        """
        names = [f.name for f in dataclasses.fields(self.config_class)]
        if fixed is None:
            fixed = () if config is None else names
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise InputTypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config
        self.user_config = config
        """The config as the user gave it (the options set, the defaults of the rest): what every :meth:`fit`
        starts from."""
        self.fixed = frozenset(fixed)
        self.requested = {name: getattr(config, name) for name in sorted(self.fixed)}
        """The options the user set, as set (:meth:`fit` leaves them so): what a saved pipeline keeps."""
        self.reset()

    @classmethod
    def from_config(cls, config: PolicyConfig | dict[str, Any] | None = None, **overrides: Any) -> TreePolicy:
        """Build from a config object, a mapping, or keyword overrides of the defaults."""
        if config is None:
            config = {}
        if isinstance(config, dict):
            values = {**config, **overrides}
            return cls(cls.config_class.from_dict(values), fixed=values)
        if overrides and isinstance(config, cls.config_class):  # another type: refused by name just below
            config.check_names(overrides)
            config = dataclasses.replace(config, **overrides)
        return cls(config)

    def reset(self) -> None:
        """Clear per-request state."""

    def begin(self, sampler: Sampler | None) -> None:
        """Start a request (the engine calls it before the prefill): clear per-request state.

        Args:
            sampler: the request's sampling settings and seeded generator, ``None`` for greedy decoding; a policy
                that draws while drafting (DSBD) keeps it. The rest receive it again in :meth:`accept`.
        """
        self.reset()

    # ---- hardware ---------------------------------------------------------------------------------------------
    def free_hardware_options(self) -> tuple[str, ...]:
        """The hardware-dependent options the user left to :meth:`fit` (budget and depth fields not in ``fixed``)."""
        c = self.config
        return tuple(f for f in (c.budget_field, c.depth_field) if f is not None and f not in self.fixed)

    def fit(self, costs: ForwardCosts, factor: float = DEFAULT_BUDGET_FACTOR, rows: int = 1) -> None:
        """Give the options the user did not set the values this machine affords (see :mod:`vlmspec.costs`).

        The node budget is ``costs.node_budget(factor)``; the depth is ``costs.depth_budget`` for that budget
        (the configured one where the user set it, the machine's where the policy has none). Called by the
        pipeline when the policy is attached; options in :attr:`fixed` are never changed. Clears request state.
        ``rows``: the requests verified together (batched decoding); the budget is then each request's. Each fit
        starts from :attr:`user_config`, not from an earlier fit's result (a refit on other costs is a fresh fit).
        """
        c, free = self.user_config, self.free_hardware_options()
        if not free:
            return
        nodes = costs.node_budget(factor, rows) if c.budget_field in free else None
        tree_nodes = nodes or c.node_budget or costs.node_budget(factor, rows)
        depth = self.fitted_depth(costs, tree_nodes, rows) if c.depth_field in free else None
        self.config = c.with_budget(nodes, depth, self.fixed)
        self.reset()

    def fitted_depth(self, costs: ForwardCosts, nodes: int, rows: int = 1) -> int:
        """The depth :meth:`fit` gives a tree of ``nodes`` nodes when the user left it to the machine:
        :meth:`ForwardCosts.depth_budget`, the depth with the most expected tokens per second."""
        return costs.depth_budget(nodes, rows=rows)

    def expected_speedup(self, costs: ForwardCosts, rows: int = 1) -> float:
        """This policy's expected tokens per second over plain decoding's on hardware with ``costs``
        (:meth:`ForwardCosts.expected_speedup` at the default per-token acceptance): its node budget and depth as
        configured (or fitted), the machine's depth where it has none, and a chain as deep as its depth where it
        has no node bound (the cheapest tree of that depth, so the estimate errs on the fast side)."""
        c = self.config
        depth = getattr(c, c.depth_field) if c.depth_field is not None else None
        nodes = c.node_budget or depth or costs.node_budget(rows=rows)
        depth = min(depth or costs.depth_budget(nodes, rows=rows), nodes)
        return costs.expected_speedup(nodes, depth, rows=rows)

    def warn_if_slow(self, costs: ForwardCosts) -> None:
        """Warn (:class:`~vlmspec.errors.SlowSpeculationWarning`) when :meth:`expected_speedup` is below 1: the
        draft costs so much of the target on this machine that speculation is expected to lose to plain decoding
        (a separate draft on a GPU in eager mode: docs/gpu.md)."""
        speedup = self.expected_speedup(costs)
        if speedup < 1:
            ratio = costs.draft_cost(1) / costs.target_cost(1)
            warnings.warn(
                f"policy {self.name!r} is expected to run at {speedup:.2f}x plain decoding on this machine: the "
                f"draft's forward costs {ratio:.2f}x the target's, more than the accepted tokens repay at a "
                f"per-token acceptance of {DEFAULT_ACCEPTANCE}. Speculation pays when the draft costs a small "
                "fraction of the target: use a smaller draft, an EDD draft (docs/edd.md) or a Gemma 4 target's "
                "assistant (gemma4_assistant), or policy='ar'; "
                "`vlmspec bench` measures it",
                SlowSpeculationWarning,
                stacklevel=user_stacklevel(),
            )

    def build_tree(self, draft: DraftTree) -> TokenTree:
        """Grow this step's tree with ``draft`` and return it."""
        raise NotImplementedError

    def accept(
        self, tree: TokenTree, target_logits: torch.Tensor, sampler: Sampler | None = None
    ) -> Acceptance:
        """The acceptance rule (a pure function of ``verify``); lossless unless a policy overrides it.

        Args:
            tree: the verified tree, ``N + 1`` nodes.
            target_logits: ``[N+1, V]`` target logits at every node.
            sampler: ``None`` for greedy decoding, else the request's sampling settings and generator
                (tree speculative sampling: the output follows the target's warped distribution).
        """
        if sampler is None:
            return greedy_accept(tree, target_logits)
        return sample_accept(tree, sampler.probs(target_logits), sampler.generator)

    @property
    def lossless(self) -> bool:
        """False only for policies configured with a lossy acceptance rule (reported in ``stats.lossless``)."""
        return True

    sampling_only: bool = False
    """True for a policy with no greedy form (DSBD, beam *sampling*): it decodes only with ``do_sample=True``."""

    def feedback(self, step: StepFeedback) -> None:
        """Optional hook: the outcome of the step just verified."""

    def trace(self) -> dict[str, Any]:
        """The values that shaped the last tree (recorded per step in ``stats.trace``)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


_REGISTRY: dict[str, type[TreePolicy]] = {}
P = TypeVar("P", bound=type[TreePolicy])


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator registering a :class:`TreePolicy` under ``name``."""

    def wrap(cls: P) -> P:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise InvalidInputError(
                f"a policy named {name!r} is already registered ({_REGISTRY[name].__name__})"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_policies() -> list[str]:
    """Names of all registered policies."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[TreePolicy]:
    """The policy class registered as ``name``.

    Raises:
        InputTypeError: ``name`` is not a string.
        InvalidInputError: no policy has that name; the message lists those that do.
    """
    if not isinstance(name, str):
        raise InputTypeError(
            f"a policy name must be a string, got {type(name).__name__} {name!r:.80}; available policies: "
            f"{', '.join(available_policies())}"
        )
    if name not in _REGISTRY:
        raise InvalidInputError(
            f"unknown policy {name!r}; available policies: {', '.join(available_policies())}"
        )
    return _REGISTRY[name]


def get_policy(
    name: str, config: PolicyConfig | dict[str, Any] | str | Path | None = None, **options: Any
) -> TreePolicy:
    """Instantiate a registered policy by name.

    Args:
        name: registered policy name (see :func:`available_policies`).
        config: a config object, a mapping, or the path of a YAML file of options (``configs/policies/*.yaml``:
            ``get_policy("sage_paper", "configs/policies/sage_paper.yaml")``; its ``policy:`` key, if any, must be
            ``name``); ``options`` override its fields. A mapping's or a file's options are the user's (kept as
            given), the rest are fitted to the machine in a pipeline.

    Raises:
        ValueError: unknown name, unknown option, or an invalid option value.
    """
    cls = policy_class(name)
    if isinstance(config, (str, Path)):
        return cls.from_config({**cls.config_class.yaml_options(config, name), **options})
    return cls.from_config(config, **options)


def check_greedy(policy: TreePolicy, greedy: str, instead: str) -> None:
    """Refuse a policy with no greedy form (:attr:`TreePolicy.sampling_only`, DSBD) in an entry point that decodes
    greedily, before any model loads.

    Args:
        greedy: what decodes greedily, as the message says it (``"vlmspec demo decodes greedily"``).
        instead: what to use instead, as the message ends (``"use a lossless policy such as --policy sage"``).

    Raises:
        InvalidInputError: ``policy`` decodes only with sampling.
    """
    if policy.sampling_only:
        raise InvalidInputError(
            f"policy {policy.name!r} has no greedy form (it decodes only with sampling, do_sample=True), and "
            f"{greedy}: {instead}"
        )


def registered_names(config_class: type[PolicyConfig]) -> list[str]:
    """The names of the policies registered with ``config_class`` (``SAGEConfig``: ``["sage"]``)."""
    return [name for name, cls in _REGISTRY.items() if cls.config_class is config_class]


def policy_with(policy: str | TreePolicy, options: dict[str, Any]) -> TreePolicy:
    """The policy a pipeline is built with: a registered name with its options (:func:`get_policy`), or a policy
    object alone.

    Raises:
        InputTypeError: a policy's config object instead of a policy (the message says how to pass it).
        InvalidInputError: options beside a policy object (which has its own config: they would be ignored).
    """
    if isinstance(policy, PolicyConfig):
        name = next(iter(registered_names(type(policy))), "<name>")
        raise InputTypeError(
            f"policy={type(policy).__name__}(...) is a policy's config, not a policy: pass "
            f"policy=get_policy({name!r}, config), or policy={name!r} with the options you set as keywords"
        )
    if not isinstance(policy, TreePolicy):
        return get_policy(policy, **options)
    if options:
        raise InvalidInputError(
            f"policy options {', '.join(sorted(options))} were given with a policy object ({policy.name!r}), "
            f"which has its own config: pass policy={policy.name!r} with them, or build the object with them "
            f"(get_policy({policy.name!r}, ...))"
        )
    return policy
