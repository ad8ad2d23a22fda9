"""``dsbd``: Dynamic-Width Speculative Beam Decoding (``shared/papers/dsbd.txt``) in its memory mode.

DSBD speeds up *beam sampling* (not plain sampling): each iteration the draft runs beam sampling for ``gamma``
steps, the target verifies the resulting draft forest layer by layer in one forward (Algorithm 1), and every
layer that passes yields beams distributed exactly as the target's beam sampling would draw them (Theorem 3.1).

Memory mode only (paper section 3.4). The engine keeps ONE target KV cache and ONE sequence, so each iteration
has a single input beam: the lowest-perplexity output beam of the previous iteration, which the engine carries
as its accepted path. The forest mode of sections 3.1/3.3 (several input beams, one KV cache per input beam,
forest-based parallel decoding) is not supported by this engine - it would need one cache and one tree per
input beam and an acceptance that returns several sequences - and ``memory_mode=False`` is rejected.

One step, from the input beam (the tree's root; its beam probability is 1 and cancels):

1. Draft (``build_tree``). Layer ``l = 1..gamma`` holds ``W_S`` draft beams ("slots") drawn i.i.d. from the draft's
   beam-level distribution over (slot of layer ``l-1``) x (next token)::

       q_beam(s, x) = Q(s) q~(x | s) / sum_{s'} Q(s')

   ``q~`` the draft's next-token distribution warped like the request (temperature, top-k, top-p), ``Q(s)`` the
   product of ``q~`` along the beam (kept in log space). Draws that are the same (node, token) share one tree
   node; slots keep their multiplicity. One batched ``DraftTree.next_probs`` per layer (``gamma`` forwards).
2. Verify (``accept``, Algorithm 1). Layer ``l``'s candidates are ``A x V`` with ``A`` the slots accepted at layer
   ``l - 1`` (the root for ``l = 1``); ``p_beam(s, x) = P(s) p~(x | s) / sum_{s' in A} P(s')`` with ``p~`` the target's
   warped distribution (``sampler.probs``) and ``P`` the product of ``p~`` along the beam. The layer's draft beams
   whose parent slot is not in ``A`` are rejected (line 10); the others are i.i.d. draws from ``q_beam``
   restricted to ``A x V`` and renormalised, which is therefore the ``q`` they are verified against. The width
   ``W_L`` comes from Eq. 2-7 (:func:`~vlmspec.verify.dynamic_width`), then
   :func:`~vlmspec.verify.verify_beam_layer` accepts with ``min(1, p'/q)`` and the residual update
   ``p' = norm(max(0, p' - q))``. A layer with ``W_L`` accepted beams passes; the first layer that does not is
   completed by sampling (one beam from ``p'``, the rest from ``p_beam``) and ends verification. When all
   ``gamma`` layers pass, ``W_L`` beams of layer ``gamma + 1`` are sampled from its ``p_beam``.
3. Memory mode: of the output beams of that last layer, the one with the lowest perplexity under the target (the
   highest raw target log-likelihood: all have the same prefix and length) is carried. An output beam is
   always (a node of the previous layer, a token), so the acceptance is ``path_to(parent)`` plus that token as
   the engine's next token: a step emits ``l_last`` tokens (Theorem 3.2's "generated steps").

What the output follows (why ``lossless`` is False). Every verified layer's output beams are i.i.d. the
*target's* beam-sampling distribution ``p_beam`` over the accepted beams of the layer before (Theorem 3.1, the
draft only changes speed). The whole output is the law of this procedure: per step, target beam sampling from
the single input beam with widths ``W_L^(1..l_last)``, then the highest-likelihood beam of layer ``l_last`` is
kept. The widths (Eq. 6) and the layer ``l_last`` at which one beam is kept depend on the draft (its agreement
with the target), so the output is not the law of any target-only decoding of the same kind - neither the
target's multinomial sampling nor ``generate(num_beams=W, do_sample=True)`` (which, besides fixed widths, draws
``2W`` candidates without replacement and keeps the top ``W`` by score, not ``W`` i.i.d. draws as the paper's
beam sampling). ``stats.lossless`` means "identical in law to the target's own decoding of the same kind", so
it is False.

Choices where the paper is open (and why):

* Beam distributions: ``p_beam``/``q_beam`` are the warped (top-k/top-p, renormalised per beam) next-token
  distribution times the beam probability, the beam probability being the product of the *warped* conditionals
  along the beam, normalised over the layer's candidates. Section 3.1 writes ``T o (p(x_1:t+1) / P)`` without
  saying whether ``T`` acts per beam or over the whole layer; per beam matches multinomial sampling (width 1)
  and transformers' per-beam warpers.
* Draft beams are i.i.d. draws (with replacement), as Theorem 3.1's proof needs (independent unverified beams).
* ``M_S`` of Eq. 5/7 is the number of draft beams actually verified at the layer (those whose parents survived),
  and ``q_beam`` for Eq. 4 is the restricted one: the probability that at least ``K`` of *them* pass is what
  ``t`` bounds. Eq. 7's sum from ``k = 0`` is used (Eq. 5's ``k = 1`` would not be a probability of "at least K").
* Width of the extra layer ``gamma + 1`` (Algorithm 1 line 33 says ``W_L``, undefined with dynamic widths):
  ``W_L`` of the last verified layer; ``w_min`` when no layer was drafted.
* Perplexity for the memory-mode choice is the target's *raw* (unwarped) likelihood, as the paper measures PPL;
  ties go to the first output beam (accepted draft beams come first).
* Randomness: the draft's beam draws and the verification use the request's seeded generator (one stream), so a
  seed fixes the run and different seeds give independent drafts. The engine hands the policy the request's
  sampler before the prefill (``begin``), so drafting starts at the first step.
* Warping: the request's temperature/top-k/top-p (``sampler.params``) for both models, so the engine's first
  token and every ``p_beam`` use one ``T``. The config's ``top_k``/``top_p`` (paper section 4: 10, 0.8) must
  equal the request's; ``None`` follows the request. A mismatch is an error naming both.
* Greedy decoding (``do_sample=False``) is an error: DSBD is beam *sampling* and has no greedy form here.

Per-step state: ``build_tree`` stores what it drafted (slots per layer, their parents, the draft's warped
distributions and beam probabilities) on the instance for the following ``accept``; ``reset`` clears it and the
request's sampler.

The baseline DSBD is measured against (the target's own beam sampling) and the perplexity measure live with the
bench, in ``vlmspec_eval.dsbd_baseline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..draft import DraftTree
from ..errors import InvalidInputError
from ..sampling import Sampler, SamplingParams, draw
from ..tree import TokenTree
from ..verify import (
    Acceptance,
    beam_acceptance_probs,
    beam_distribution,
    dynamic_width,
    verify_beam_layer,
)
from .base import PolicyConfig, TreePolicy, check, check_positive_int, is_int, register_policy

PAPER_TOP_K = 10
PAPER_TOP_P = 0.8


@dataclass(frozen=True)
class DSBDConfig(PolicyConfig):
    """DSBD hyper-parameters (paper section 4 and its grid).

    Args:
        gamma: draft layers per step, ``gamma`` (3; grid {2, 3}: the deeper one, more tokens per verification).
        draft_width: ``W_S``, draft beams per layer (4; grid {2..6}: the middle, and ``> W_L`` leaves room for
            rejections while keeping the draft's layer forward small).
        threshold: ``t`` of Eq. 6-7 (0.9; grid {0.7, 0.9}: 0.9 is the efficient end - narrower layers that pass
            more often - which suits memory mode, where only one beam is carried anyway).
        w_min: ``W_min`` (1, section 4).
        top_k, top_p: the warping the request must use (10, 0.8, section 4); ``None`` follows the request.
        memory_mode: must be True (section 3.4: one input beam, one KV cache - what the engine supports).
    """

    gamma: int = 3
    draft_width: int = 4
    threshold: float = 0.9
    w_min: int = 1
    top_k: int | None = PAPER_TOP_K
    top_p: float | None = PAPER_TOP_P
    memory_mode: bool = True

    def __post_init__(self) -> None:
        check_positive_int(self, "gamma")
        check_positive_int(self, "draft_width")  # fmt: skip
        check(isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold <= 1.0, self, "threshold",
              self.threshold, "a number in [0, 1]")  # fmt: skip
        check(is_int(self.w_min) and 1 <= self.w_min <= self.draft_width, self, "w_min", self.w_min,
              f"an integer in [1, draft_width] ([1, {self.draft_width}])")  # fmt: skip
        check(self.top_k is None or (is_int(self.top_k) and self.top_k >= 0), self, "top_k", self.top_k,
              "an integer >= 0 (0: no top-k) or None (follow the request)")  # fmt: skip
        check(self.top_p is None or (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1), self, "top_p",
              self.top_p, "a number in (0, 1] or None (follow the request)")  # fmt: skip
        check(self.memory_mode is True, self, "memory_mode", self.memory_mode,
              "only True is supported: the engine keeps one target KV cache and one sequence, so DSBD runs in its "
              "memory mode (paper 3.4: the lowest-perplexity output beam is the next single input beam); the "
              "forest mode with one KV cache per input beam (paper 3.3) is not supported")  # fmt: skip


@dataclass
class _Drafted:
    """What ``build_tree`` drafted, for ``accept`` (tree node ids are the DraftTree's, i.e. the tree's)."""

    num_nodes: int
    slot_nodes: list[torch.Tensor]  # per layer 0..L: [S_l] node of each slot (layer 0: the root)
    slot_parents: list[torch.Tensor]  # per layer 1..L (index l-1): [W_S] parent slot (index into layer l-1)
    slot_rows: list[torch.Tensor]  # per layer 0..L-1: [S_l] row of each slot in q_rows[l]
    q_rows: list[torch.Tensor]  # per layer 0..L-1: [U_l, V] warped draft distributions at the layer's nodes
    slot_logq: list[torch.Tensor]  # per layer 0..L: [S_l] log draft beam probability of each slot

    @property
    def layers(self) -> int:
        return len(self.slot_parents)


@register_policy("dsbd")
class DSBDPolicy(TreePolicy):
    """Speculative beam sampling, memory mode (module docstring: algorithm, output law, choices)."""

    config_class = DSBDConfig
    sampling_only = True

    def begin(self, sampler: Sampler | None) -> None:
        self._check_sampler(sampler)
        self.reset()
        self._sampler = sampler

    def reset(self) -> None:
        self._sampler: Sampler | None = None  # the request's sampler (begin())
        self._drafted: _Drafted | None = None  # this step's draft, from build_tree() for accept()
        self._last: dict[str, Any] = {}

    @property
    def lossless(self) -> bool:
        """False: the output follows DSBD's beam-sampling law (module docstring), not the target's own decoding."""
        return False

    # ---- draft -------------------------------------------------------------------------------------------------
    def build_tree(self, draft: DraftTree) -> TokenTree:
        c = self.config
        self._drafted = None
        gamma = min(c.gamma, draft.depth_limit)
        if self._sampler is None or gamma < 1:  # no request begun (no sampler to draw with) or no room left
            self._last = {"gamma": 0}
            return draft.tree()
        params, gen = self._sampler.params, self._sampler.generator
        device = draft.tokens.device
        root = torch.zeros(1, dtype=torch.long, device=device)
        rows = _warp(params, draft.next_probs(root))  # [1, V]
        vocab = rows.shape[1]
        slot_nodes, slot_parents = [root], []
        slot_logq = [torch.zeros(1, dtype=torch.float64, device=device)]  # log Q(s): draft beam probability
        slot_rows, q_rows = [torch.zeros(1, dtype=torch.long, device=device)], [rows]
        for level in range(1, gamma + 1):
            prev = slot_nodes[-1]  # [S]
            # q_beam over (slot of the previous layer) x (token): Q(s) q~(x | s), normalised.
            q_beam = beam_distribution(_layer_weights(slot_logq[-1]), rows[slot_rows[-1]])  # [S * V]
            picks = draw(q_beam.to(gen.device), gen, c.draft_width)
            picks = picks.to(device)
            parent_slot, token = picks // vocab, picks % vocab  # [W_S]
            parent_node = prev[parent_slot]
            draw_probs = rows[slot_rows[-1][parent_slot], token]  # q~(token | parent) of each draw
            # Same (node, token) drawn twice is one tree node; slots keep the multiplicity.
            keys, inverse = torch.unique(parent_node * vocab + token, return_inverse=True)
            u_probs = torch.zeros(keys.shape[0], dtype=draw_probs.dtype, device=device)
            u_probs.scatter_(0, inverse, draw_probs)  # duplicates carry the same value
            ids = draft.add(keys // vocab, keys % vocab, u_probs)
            if ids.shape[0] != keys.shape[0]:
                raise RuntimeError("DSBDPolicy: the draft tree dropped nodes within its depth limit")
            slot_nodes.append(ids[inverse])
            slot_parents.append(parent_slot)
            slot_logq.append(slot_logq[-1][parent_slot] + draw_probs.double().log())
            if level < gamma:  # next layer's draft distributions: one batched forward over this layer
                rows = _warp(params, draft.next_probs(ids))
                slot_rows.append(inverse)  # unique node i of this layer is row i (ids are in key order)
                q_rows.append(rows)
        self._drafted = _Drafted(
            num_nodes=draft.num_nodes,
            slot_nodes=slot_nodes,
            slot_parents=slot_parents,
            slot_rows=slot_rows,
            q_rows=q_rows,
            slot_logq=slot_logq,
        )
        self._last = {"gamma": gamma}
        return draft.tree()

    # ---- verify ------------------------------------------------------------------------------------------------
    def accept(
        self, tree: TokenTree, target_logits: torch.Tensor, sampler: Sampler | None = None
    ) -> Acceptance:
        c = self.config
        self._check_sampler(sampler)
        self._sampler = sampler
        drafted, self._drafted = self._drafted, None
        if drafted is None:
            if tree.num_nodes:
                raise RuntimeError("DSBDPolicy.accept: the tree was not built by this policy's build_tree")
        elif tree.num_nodes != drafted.num_nodes:
            raise RuntimeError("DSBDPolicy.accept: the tree differs from the one build_tree drafted")
        gen = sampler.generator
        device = target_logits.device
        vocab = target_logits.shape[-1]
        p_next = sampler.probs(target_logits).double()  # [N+1, V] warped target distributions p~
        log_raw = torch.log_softmax(target_logits.double(), dim=-1).clamp_min(-1e30)  # raw, for perplexity
        beam_logp = _beam_logprobs(tree, p_next)  # [N+1] log P: product of p~ along each beam
        anc = tree.ancestors.to(torch.float64)
        edge_raw = torch.zeros(tree.tokens.shape[0], dtype=torch.float64, device=device)
        edge_raw[1:] = log_raw[tree.parents[1:], tree.tokens[1:]]
        loglik = anc @ edge_raw  # [N+1] raw target log-likelihood of each beam from the root

        widths: list[int] = []
        passed: list[int] = []
        a_slots = torch.zeros(1, dtype=torch.long, device=device)  # accepted slots of the previous layer
        a_nodes = torch.zeros(1, dtype=torch.long, device=device)
        outputs = None
        layers = drafted.layers if drafted is not None else 0
        for level in range(1, layers + 1):
            p_beam = beam_distribution(_layer_weights(beam_logp[a_nodes]), p_next[a_nodes])  # [|A| * V]
            q_rows = drafted.q_rows[level - 1].to(device)[drafted.slot_rows[level - 1].to(device)[a_slots]]
            q_weights = _layer_weights(drafted.slot_logq[level - 1].to(device)[a_slots])
            q_beam = beam_distribution(q_weights, q_rows)  # q_beam restricted to A x V, renormalised
            # Line 10: only draft beams whose parent slot was accepted; their index in A x V.
            where = torch.full((drafted.slot_nodes[level - 1].shape[0],), -1, dtype=torch.long, device=device)
            where[a_slots] = torch.arange(a_slots.shape[0], device=device)
            parents = where[drafted.slot_parents[level - 1].to(device)]  # [W_S] position in A or -1
            alive = (parents >= 0).nonzero().flatten()  # this layer's draft slots still in play, in order
            tokens = tree.tokens[drafted.slot_nodes[level].to(device)[alive]]
            draws = parents[alive] * vocab + tokens
            width = dynamic_width(beam_acceptance_probs(p_beam, q_beam, draws.shape[0]), c.threshold, c.w_min)
            layer = verify_beam_layer(p_beam, q_beam, draws, width, gen)
            widths.append(width)
            passed.append(int(layer.accepted.shape[0]))
            if not layer.complete:
                outputs = layer.outputs
                break
            a_slots = alive[layer.accepted]
            a_nodes = drafted.slot_nodes[level].to(device)[a_slots]
        if outputs is None:  # every drafted layer passed (or none was drafted): sample layer gamma + 1
            width = widths[-1] if widths else c.w_min
            p_beam = beam_distribution(_layer_weights(beam_logp[a_nodes]), p_next[a_nodes])
            outputs = draw(p_beam, gen, width)
            widths.append(width)
        # Memory mode: carry the output beam with the lowest perplexity (highest raw likelihood, first on ties).
        out_parents, out_tokens = a_nodes[outputs // vocab], outputs % vocab
        score = loglik[out_parents] + log_raw[out_parents, out_tokens]
        best = int(score.argmax())
        self._last.update(
            {
                "widths": widths,
                "accepted_beams": passed,
                "layers": len(widths),
                "output_beams": int(outputs.shape[0]),
            }
        )
        return Acceptance.at(tree, out_parents[best], out_tokens[best])

    def _check_sampler(self, sampler: Sampler | None) -> None:
        """Refuse greedy decoding and a request warped otherwise than the config says."""
        if sampler is None:
            raise InvalidInputError(
                "policy 'dsbd' is speculative beam *sampling* and has no greedy form: call the pipeline with "
                "do_sample=True (e.g. pipe(image, prompt, do_sample=True, top_k=10, top_p=0.8, seed=0)), or use a "
                "lossless policy such as 'sage' for greedy decoding"
            )
        c, params = self.config, sampler.params
        want_k = None if c.top_k is None else (c.top_k or 0)
        want_p = None if c.top_p is None else float(c.top_p)
        got_k, got_p = params.top_k or 0, 1.0 if params.top_p is None else float(params.top_p)
        if (want_k is not None and want_k != got_k) or (want_p is not None and want_p != got_p):
            raise InvalidInputError(
                f"policy 'dsbd' is configured for top_k={c.top_k}, top_p={c.top_p} (paper section 4) but this call "
                f"samples with top_k={params.top_k}, top_p={params.top_p} (call arguments over the target's "
                f"generation_config); pass top_k={c.top_k}, top_p={c.top_p} to the call, or configure dsbd with "
                "top_k=None, top_p=None to follow the call's warping"
            )

    def trace(self) -> dict[str, Any]:
        return dict(self._last)


def _warp(params: SamplingParams, probs: torch.Tensor) -> torch.Tensor:
    """The draft's distributions warped like the request (log-probabilities are valid logits for every warper)."""
    return params.probs(probs.log())


def _beam_logprobs(tree: TokenTree, p_next: torch.Tensor) -> torch.Tensor:
    """``[N+1]`` log of the product of the warped target probabilities along each node's beam (root 0).

    ``-inf`` where some token of the beam is outside the target's warped support.
    """
    n = tree.tokens.shape[0]
    edge = torch.ones(n, dtype=torch.float64, device=p_next.device)
    edge[1:] = p_next[tree.parents[1:], tree.tokens[1:]]
    anc = tree.ancestors
    zero = (anc & (edge == 0)[None, :]).any(dim=1)
    logp = anc.to(torch.float64) @ edge.clamp_min(1e-300).log()
    return logp.masked_fill(zero, float("-inf"))


def _layer_weights(logp: torch.Tensor) -> torch.Tensor:
    """Beam probabilities of one layer's beams from their log-probabilities, scaled so the largest is 1."""
    return (logp - logp.max()).exp()
