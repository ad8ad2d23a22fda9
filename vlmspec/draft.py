"""Drafting: the handle a tree policy uses to grow a tree with the draft model.

A policy sees one :class:`DraftTree` per decoding step. It asks for the draft's next-token distribution at a
set of nodes (``next_probs``) — one batched draft forward over all of them, under a tree mask — and adds
children (``add``). Nothing else about the draft model leaks into policies.

Draft cache layout during a step::

    [ committed prompt + text (C) | pending tokens (p) | root | forwarded tree nodes in expansion order ]

*Pending* tokens are accepted tokens the draft has not consumed yet (the previous step's bonus token and any
accepted leaf that was never expanded). They are fed together with the root in the first forward. After
verification, :meth:`DraftTree.commit` keeps the accepted path's entries and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .cache import keep_tail, truncate
from .models import DecodeState, VLMAdapter
from .tree import TokenTree, tree_attention_bias

_GROW = 64


@dataclass(frozen=True)
class DraftVocab:
    """How the draft's token ids meet the target's when their embedding tables differ in size: checkpoints of one
    series pad their vocabularies differently (Qwen2-VL-7B has 152064 rows, Qwen2-VL-2B 151936, one tokenizer).

    The draft only proposes and the target decides, so both fixes below leave the output the target's: a token the
    draft cannot embed is fed to it as a stand-in (its proposals after it are merely worse), and the draft never
    proposes a token the target could not verify. Both are tensor ops on the device (no host sync).

    Attributes:
        width: the target's logits width; the draft's distributions are given over it (DSBD compares the two).
        proposable: the draft proposes ids below this only: ids both tables and the target's tokenizer hold. Its
            probabilities at and beyond it are 0 (the rest renormalised), so sampling stays lossless too.
        embeddable: rows of the draft's input table; a token at or beyond it (one the target emitted) is fed to
            the draft as the last row.
    """

    width: int
    proposable: int
    embeddable: int

    def fit(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V_draft]`` draft logits as ``[n, width]`` with ``-inf`` at every id the draft may not propose."""
        if logits.shape[-1] == self.width == self.proposable:
            return logits
        kept = logits[..., : self.proposable]
        banned = kept.new_full((*kept.shape[:-1], self.width - self.proposable), float("-inf"))
        return torch.cat([kept, banned], dim=-1)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[n]`` as the draft can embed them (``[n]``): an id beyond its table becomes its last row."""
        return tokens.clamp(max=self.embeddable - 1)


class DraftConstraint(Protocol):
    """What the draft may propose after each node, beyond its vocabulary (a request's structured outputs,
    :class:`~vlmspec.structured.GrammarGuide`)."""

    def allowed(self, tokens: torch.Tensor, parents: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``[k, V]`` bool: the tokens allowed after each of ``nodes`` ``[k]`` of a tree of ``tokens``, ``parents``."""
        ...


def draft_vocab(
    target: torch.nn.Module, draft: torch.nn.Module | None, processor: Any = None
) -> DraftVocab | None:
    """The :class:`DraftVocab` of a pair (``processor``: the target's, whose tokenizer bounds the ids too, when it
    has one); ``None`` without a draft."""
    if draft is None:
        return None
    tokenizer = getattr(processor, "tokenizer", None)
    t_rows, t_width = _rows(target)
    d_rows, d_width = _rows(draft)
    known = [len(tokenizer)] if tokenizer is not None else []
    return DraftVocab(
        width=t_width, proposable=min(t_rows, t_width, d_rows, d_width, *known), embeddable=d_rows
    )


def _rows(model: torch.nn.Module) -> tuple[int, int]:
    """Rows of ``model``'s input embedding table and of its output head (the table's, when it has no head)."""
    return model.get_input_embeddings().weight.shape[0], logits_width(model)


def logits_width(model: torch.nn.Module) -> int:
    """How many logits ``model`` gives per position: its output head's rows (its input table's when it has none)."""
    head = model.get_output_embeddings()
    return (head if head is not None else model.get_input_embeddings()).weight.shape[0]


_NODE_ARRAYS: tuple[tuple[str, torch.dtype, float], ...] = (
    ("_tokens", torch.long, 0),
    ("_parents", torch.long, -1),
    ("_depths", torch.long, 0),
    ("_probs", torch.float32, 1.0),
    ("_cum", torch.float32, 1.0),
    ("_slots", torch.long, -1),  # the node's draft cache index once it is forwarded
)
"""A :class:`DraftTree`'s per-node arrays, indexed by node id and grown together: attribute, dtype, and what an
entry holds before its node is added."""


class _NodeView:
    """A read-only :class:`DraftTree` attribute: the nodes' entries of one of its :data:`_NODE_ARRAYS`
    (``[num_nodes + 1]``, the root first)."""

    def __init__(self, array: str) -> None:
        self.array = array

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, tree: DraftTree | None, owner: type | None = None) -> Any:
        return self if tree is None else getattr(tree, self.array)[: tree._n]

    def __set__(self, tree: DraftTree, value: Any) -> None:
        raise AttributeError(f"DraftTree.{self.name} is read-only")


class DraftTree:
    """A token tree under construction, backed by the draft model.

    Node 0 is the root. Node attributes are tensors indexed by node id (valid up to ``num_nodes``):
    ``tokens``, ``parents``, ``depths``, ``probs`` (the draft probability of the node's token given its parent)
    and ``cum_probs`` (product of ``probs`` along the path from the root).

    Args:
        adapter: the draft model's adapter.
        state: the draft's decoding state (its cache is extended in place).
        root: ``[]`` long, the root token.
        root_position: logical position of the root.
        pending: ``[p]`` long, accepted tokens before the root that the draft has not consumed yet (for a draft
            that reads the target's hidden states: ``[p, D]``, the target's hidden states of those tokens).
        depth_limit: children deeper than this are silently not added (the engine lowers it near
            ``max_new_tokens`` so no verification work is wasted).
        vocab: the pair's :class:`DraftVocab` (``None``: the draft's ids are the target's, as they are).
        constraint: what the draft may propose after each node (``None``: any token of ``vocab``); its
            distributions are renormalised over the allowed tokens (a node allowing none keeps them all).
    """

    def __init__(
        self,
        adapter: VLMAdapter,
        state: DecodeState,
        root: torch.Tensor,
        root_position: int,
        pending: torch.Tensor,
        depth_limit: int,
        vocab: DraftVocab | None = None,
        constraint: DraftConstraint | None = None,
    ) -> None:
        self.adapter = adapter
        self.vocab = vocab
        self.constraint = constraint
        self.dtype = adapter.dtype
        self.state = state
        self.root_position = root_position
        self.pending = pending
        self.depth_limit = depth_limit
        device = root.device
        self._n = 1
        cap = _GROW
        for name, dtype, fill in _NODE_ARRAYS:
            setattr(self, name, torch.full((cap,), fill, dtype=dtype, device=device))
        self._anc = torch.zeros(cap, cap, dtype=torch.bool, device=device)
        self._tokens[0] = root
        self._anc[0, 0] = True
        self._start = state.length  # C: committed entries
        self._order = torch.zeros(0, dtype=torch.long, device=device)  # forwarded node ids in cache order
        # Host-side bookkeeping, so that growing a tree needs no host sync of its own:
        self._root_slot: int | None = None  # the root's cache index once it is expanded
        # An upper bound on the deepest node's depth (each add goes one level deeper at most).
        self._depth_bound = 0

    # ---- read access for policies ----------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, root excluded."""
        return self._n - 1

    tokens = _NodeView("_tokens")
    parents = _NodeView("_parents")
    depths = _NodeView("_depths")
    probs = _NodeView("_probs")
    cum_probs = _NodeView("_cum")

    # ---- growing ---------------------------------------------------------------------------------------------
    def add(self, parents: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Append children.

        Args:
            parents: ``[m]`` long, existing node ids.
            tokens: ``[m]`` long, child tokens.
            probs: ``[m]`` float, draft probability of each child token given its parent.

        Returns:
            ``[m']`` long ids of the added nodes, in input order; children beyond ``depth_limit`` are dropped.
        """
        depths = self._depths[parents] + 1
        if self._depth_bound + 1 > self.depth_limit:
            # Only near max_new_tokens: drop what is too deep (a host sync).
            ok = depths <= self.depth_limit
            parents, tokens, probs, depths = parents[ok], tokens[ok], probs[ok], depths[ok]
        m = parents.shape[0]
        if m == 0:
            return parents
        start, end = self._n, self._n + m  # the new nodes take the next ids: slices, not index lists
        self._reserve(end)
        probs = probs.float()
        self._tokens[start:end] = tokens
        self._parents[start:end] = parents
        self._depths[start:end] = depths
        self._probs[start:end] = probs
        self._cum[start:end] = self._cum[parents] * probs
        self._anc[start:end] = self._anc[parents]  # a child sees its parent's ancestors ...
        self._anc[start:end, start:end].fill_diagonal_(True)  # ... and itself
        self._n = end
        self._depth_bound = min(self._depth_bound + 1, self.depth_limit)
        return torch.arange(start, end, device=parents.device)

    def add_best(
        self, frontier: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, score: torch.Tensor, m: int
    ) -> torch.Tensor:
        """Adds the ``m`` candidates of highest ``score``: candidate ``(i, j)`` is child ``tokens[i, j]`` of
        ``frontier[i]`` with draft probability ``probs[i, j]``. They are added grouped by parent, parents in
        ``frontier`` order, each parent's in column order.

        Args:
            frontier: ``[F]`` long, existing node ids.
            tokens: ``[F, k]`` long, candidate tokens.
            probs: ``[F, k]`` float, their draft probabilities given their parents.
            score: ``[F, k]``, what ranks the candidates.
            m: candidates to add (``1 <= m <= F * k``).

        Returns:
            :meth:`add`'s ids of the added nodes.
        """
        best = score.flatten().topk(m).indices.sort().values  # [m] flat indices: by parent, then column
        return self.add_candidates(frontier, tokens, probs, best)

    def add_candidates(
        self, frontier: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, flat: torch.Tensor
    ) -> torch.Tensor:
        """Adds the candidates at ``flat``: candidate ``(i, j)`` (flat index ``i * k + j``) is child ``tokens[i, j]``
        of ``frontier[i]`` with draft probability ``probs[i, j]``.

        Args:
            frontier: ``[F]`` long, existing node ids.
            tokens, probs: ``[F, k]`` candidate tokens and their draft probabilities given their parents.
            flat: ``[m]`` long flat indices into ``[F, k]``, ascending (grouped by parent, parents in order).

        Returns:
            :meth:`add`'s ids of the added nodes.
        """
        return self.add(frontier[flat // tokens.shape[1]], tokens.flatten()[flat], probs.flatten()[flat])

    def next_probs(self, nodes: torch.Tensor) -> torch.Tensor:
        """The draft's next-token distribution after each of ``nodes``: one batched forward.

        Each node can be expanded once, the root first and on its own (its expansion also consumes the pending
        tokens). The rules are checked without a host sync (``torch._assert_async``: on a GPU a violation fails
        at the next sync, on the CPU at once).

        Args:
            nodes: ``[n]`` long node ids (all at any depths, but none expanded before).

        Returns:
            ``[n, V]`` float32 probabilities (softmax of the draft logits, temperature 1).
        """
        if self._root_slot is None:
            if nodes.shape[0] != 1:
                raise RuntimeError("DraftTree.next_probs: expand the root on its own, before its children")
            torch._assert_async(nodes[0] == 0, "DraftTree.next_probs: expand the root before its descendants")
            return self._forward_root()
        torch._assert_async(
            (self._slots[nodes] < 0).all(), "DraftTree.next_probs: a node can be expanded only once per step"
        )
        return self._forward_nodes(nodes)

    def tree(self, keep: torch.Tensor | None = None) -> TokenTree:
        """The tree as verification data; ``keep`` (ascending node ids incl. 0) selects an ancestor-closed subset.

        Raises:
            RuntimeError: ``keep`` misses an ancestor of a kept node.
        """
        if keep is None:
            n = self._n
            return TokenTree(
                tokens=self.tokens.clone(),
                parents=self.parents.clone(),
                draft_probs=self.probs.clone(),
                ancestors=self._anc[:n, :n].clone(),
                source_ids=torch.arange(n, device=self._tokens.device),
                depths=self.depths.clone(),
            )
        anc = self._anc[keep][:, keep]
        torch._assert_async(  # checked without a host sync (see next_probs)
            (anc.sum(1) == self.depths[keep] + 1).all(),
            "DraftTree.tree: `keep` must contain every ancestor of every kept node",
        )
        remap = torch.full((self._n,), -1, dtype=torch.long, device=keep.device)
        remap[keep] = torch.arange(keep.shape[0], device=keep.device)
        parents = self._parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        return TokenTree(
            tokens=self._tokens[keep],
            parents=parents,
            draft_probs=self._probs[keep],
            ancestors=anc,
            source_ids=keep,
            depths=self._depths[keep],
        )

    # ---- after verification ------------------------------------------------------------------------------------
    def cache_slots(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[k]`` long, the draft-cache index of each of ``nodes`` (``-1``: not forwarded this step)."""
        return self._slots[nodes]

    def commit(
        self, path: torch.Tensor, slots: list[int], soft_prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Keep the accepted path in the draft cache.

        Args:
            path: ``[a+1]`` long node ids of this builder (root first) that were accepted.
            slots: ``a+1`` host ints, :meth:`cache_slots` of ``path`` (read with the step's other host values, so
                the commit needs no host sync of its own).
            soft_prompt: for a draft that reads the target's hidden states (EDD): ``[a+1, D]`` the target's
                hidden states at the path. They replace the draft's own entries for those tokens: the cache is cut
                back to just before the root and they become the pending rows of the next root forward.

        Returns:
            The new pending rows: ``[p']`` long accepted tokens the draft cache does not hold (or, with
            ``soft_prompt``, ``[p', D]`` hidden states). The bonus token is not among them: it is the next step's
            root, which the next builder feeds after them.
        """
        if self._root_slot is None:  # the draft never ran this step: everything stays pending
            accepted = self._tokens[path] if soft_prompt is None else soft_prompt
            return torch.cat([self.pending, accepted])
        if (
            soft_prompt is not None
        ):  # keep the soft prompt up to the root (the pending rows fed this step too)
            truncate(self.state.cache, self._root_slot)
            return soft_prompt
        # The forwarded nodes are a prefix of the path (a node is expanded only after its parent was); when they
        # already sit right after the root (a chain), a crop keeps them.
        node_slots = slots[1:]
        forwarded = sum(slot >= 0 for slot in node_slots)
        if min(node_slots[:forwarded], default=0) < 0:
            raise RuntimeError("DraftTree.commit: an unexpanded node has children")
        start = self._root_slot + 1
        if node_slots[:forwarded] == list(range(start, start + forwarded)):
            truncate(self.state.cache, start + forwarded)
        else:
            keep_tail(self.state.cache, start, self._slots[path[1 : 1 + forwarded]])
        return self._tokens[path[1 + forwarded :]]

    # ---- internals ---------------------------------------------------------------------------------------------
    def _forward_root(self) -> torch.Tensor:
        k = self.pending.shape[0] + 1  # pending rows, then the root
        device = self._tokens.device
        positions = torch.arange(self.root_position - k + 1, self.root_position + 1, device=device)
        causal = torch.ones(k, k, dtype=torch.bool, device=device).tril()
        bias = tree_attention_bias(causal, self.state.length, self.dtype)
        pending, root = self.pending, self._tokens[0]
        if self.vocab is not None:  # the target's tokens, which the draft's table may lack
            root = self.vocab.feed(root)
            pending = pending if pending.is_floating_point() else self.vocab.feed(pending)
        logits = self.adapter.forward_root(self.state, pending, root, positions, bias)  # [k, V]
        self._root_slot = self._start + k - 1
        self._slots[0] = self._root_slot
        self._tree_start = self._start + k
        return self._probs_of(logits[-1:], self._tokens.new_zeros(1))

    def _forward_nodes(self, nodes: torch.Tensor) -> torch.Tensor:
        past = self.state.length
        n = nodes.shape[0]
        # Keys: [prefix and root (all visible) | earlier tree slots | these nodes]; a tree entry is visible to a
        # query node only when it is one of its ancestors (or itself).
        self._order = torch.cat([self._order, nodes])  # node ids in cache order after the root
        visible = self._anc[nodes][:, self._order]  # [n, t + n]
        bias = tree_attention_bias(visible, self._tree_start, self.dtype)
        positions = self.root_position + self._depths[nodes]
        logits = self.adapter.forward(self.state, self._tokens[nodes], positions, bias)  # [n, V]
        self._slots[nodes] = torch.arange(past, past + n, device=nodes.device)
        return self._probs_of(logits, nodes)

    def _probs_of(self, logits: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` float32 draft probabilities after ``nodes`` ``[n]``, over the target's ids only with a
        :class:`DraftVocab`, over the allowed ones only with a constraint."""
        logits = logits.float()
        logits = logits if self.vocab is None else self.vocab.fit(logits)
        if self.constraint is not None:
            allowed = self.constraint.allowed(self.tokens, self.parents, nodes)  # [n, V]
            masked = logits.masked_fill(~allowed, float("-inf"))
            logits = torch.where(torch.isfinite(masked).any(-1, keepdim=True), masked, logits)
        return torch.softmax(logits, dim=-1)

    def _reserve(self, size: int) -> None:
        cap = self._tokens.shape[0]
        if size <= cap:
            return
        new = max(size, 2 * cap)

        def grow(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((new,), fill, dtype=t.dtype, device=t.device)
            out[:cap] = t
            return out

        for name, _dtype, fill in _NODE_ARRAYS:
            setattr(self, name, grow(getattr(self, name), fill))
        anc = torch.zeros(new, new, dtype=torch.bool, device=self._anc.device)
        anc[:cap, :cap] = self._anc
        self._anc = anc


class MTPDraftTree(DraftTree):
    """A :class:`DraftTree` grown by a multi-token drafter (Gemma 4's assistant,
    :mod:`vlmspec.models.gemma4_assistant`): the draft keeps no cache, and each node is drafted from the state the
    forward that proposed it returned, its token's embedding, and the target's committed keys, at the root's position.

    So a level of nodes is one forward whatever their depths, no tree mask is built (a node reads no other node's
    keys, only its parent's state), and committing keeps nothing but the target's hidden state at the last accepted
    token: the next root is drafted from it.

    Args:
        as :class:`DraftTree`; ``pending`` ``[p, D]`` holds the target's last-layer outputs of the accepted tokens
        since the last forward of the root (the last one chose the root), or nothing right after the prefill (the
        state holds the prompt's).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._states: torch.Tensor | None = None  # [capacity, D] each expanded node's returned state

    def _forward_root(self) -> torch.Tensor:
        hidden = (
            self.state.hidden if self.pending.shape[0] == 0 else self.adapter.root_state(self.pending[-1:])
        )
        logits, states = self.adapter.draft_step(self.state, self._tokens[:1], hidden, self.root_position)
        self._states = states.new_zeros(self._tokens.shape[0], states.shape[-1])  # [capacity, D]
        self._states[0] = states[0]
        self._root_slot = 0
        self._slots[0] = 0  # expanded (the draft has no cache slots)
        return self._probs_of(logits, self._tokens.new_zeros(1))

    def _forward_nodes(self, nodes: torch.Tensor) -> torch.Tensor:
        parents = self._states[self._parents[nodes]]  # [n, D]
        logits, states = self.adapter.draft_step(self.state, self._tokens[nodes], parents, self.root_position)
        self._states[nodes] = states
        self._slots[nodes] = 0
        return self._probs_of(logits, nodes)

    def _reserve(self, size: int) -> None:
        super()._reserve(size)
        states = self._states
        if states is not None and states.shape[0] < self._tokens.shape[0]:
            grown = states.new_zeros(self._tokens.shape[0], states.shape[-1])
            grown[: states.shape[0]] = states
            self._states = grown

    def commit(
        self, path: torch.Tensor, slots: list[int], soft_prompt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Nothing to keep in a cache; the new pending row is the target's hidden state at the last accepted token
        (``soft_prompt[-1:]``, ``[1, D]``), the one the next root is drafted from."""
        return soft_prompt[-1:]


def draft_tree(adapter: VLMAdapter, *args: Any, **kwargs: Any) -> DraftTree:
    """The tree builder for ``adapter``'s draft: :class:`MTPDraftTree` for a multi-token drafter, else
    :class:`DraftTree` (same arguments)."""
    return (MTPDraftTree if adapter.mtp_draft else DraftTree)(adapter, *args, **kwargs)
