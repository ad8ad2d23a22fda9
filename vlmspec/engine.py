"""The decoding loop: draft -> build tree -> verify -> accept -> update caches -> feed back stats.

One function, :func:`speculative_generate`, in the spirit of gpt-fast's ``generate.py``. Shapes in comments:
``N`` draft nodes (the tree has ``N + 1`` with the root), ``V`` vocabulary, ``T`` target cache length.

It runs under ``torch.inference_mode`` (as the adapters' forwards do), not only ``no_grad``: no version counters
or autograd bookkeeping on any tensor, which cuts the eager dispatch of a step's many small ops (the tree, masks,
cache surgery) and of the small draft's forwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import keep_tail, truncate
from .draft import DraftTree, DraftVocab, draft_tree
from .errors import InvalidInputError
from .inputs import on_device
from .models import DecodeState, VLMAdapter
from .node_processors import NodeProcessing
from .policies import StepFeedback, TreePolicy
from .processors import LogitsProcessing
from .sampling import Sampler, SamplingParams
from .scores import ScoreLog, TokenScores
from .stopping import StopCriteria
from .structured import Grammar
from .timing import StageClock
from .tree import TokenTree
from .verify import Acceptance


@dataclass
class SpecStats:
    """Statistics of one generation.

    Attributes:
        policy: name of the tree policy.
        steps: target forwards after the prefill (verification steps).
        new_tokens: tokens generated (the prefill's first token included, as ``generate()`` counts them).
        accepted_tokens: draft tokens accepted over all steps.
        mean_accepted: tau, accepted draft tokens per step (bonus token excluded).
        tokens_per_step: tokens emitted per verification step (tau + 1 unless cut by a stop condition).
        tokens_per_second: ``new_tokens`` / ``total_seconds``.
        total_seconds: wall time of the whole generation (prefills included).
        prefill_seconds: target prefill.
        draft_prefill_seconds: draft prefill (0 when the policy does not use the draft).
        draft_seconds: tree building (draft forwards and policy logic).
        verify_seconds: target tree forwards, acceptance and cache updates. The four stage times split the
            device's timeline on a GPU (CUDA events, read once at the end) and the host's elsewhere
            (:mod:`vlmspec.timing`).
        tree_sizes: draft nodes verified at each step.
        lossless: True unless an opt-in lossy acceptance rule was used.
        prompt_tokens: tokens in the prompt.
        cached_prompt_tokens: prompt tokens the target took from a cache instead of prefilling them (a
            prefix cache, :mod:`vlmspec.prefix_cache`, or a conversation's earlier turns; 0 for a fresh prompt).
        target_visual_tokens: visual tokens in the target's prefill.
        draft_visual_tokens: visual tokens in the draft's prefill (after pruning).
        trace: one dict per step: what the policy used to shape the tree, plus ``tree_size``/``accepted``.
    """

    policy: str = ""
    steps: int = 0
    new_tokens: int = 0
    accepted_tokens: int = 0
    mean_accepted: float = 0.0
    tokens_per_step: float = 0.0
    tokens_per_second: float = 0.0
    total_seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    tree_sizes: list[int] = field(default_factory=list)
    lossless: bool = True
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    target_visual_tokens: int = 0
    draft_visual_tokens: int = 0
    trace: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def summary(self) -> str:
        """One line for logs and the demo."""
        return (
            f"policy={self.policy} new_tokens={self.new_tokens} steps={self.steps} tau={self.mean_accepted:.2f} "
            f"tokens/step={self.tokens_per_step:.2f} tokens/s={self.tokens_per_second:.1f} "
            f"mean_tree={sum(self.tree_sizes) / max(len(self.tree_sizes), 1):.1f} "
            f"(prefill {self.prefill_seconds:.2f}s, draft {self.draft_seconds:.2f}s, verify {self.verify_seconds:.2f}s)"
        )


@dataclass
class SpecOutput:
    """Result of one pipeline call.

    Attributes:
        text: the decoded generation (special tokens skipped).
        token_ids: generated token ids (EOS included when produced, as ``generate()`` returns them).
        stats: speed and acceptance statistics.
        scores: with ``output_scores=True``, the target's logits and scores behind each of ``token_ids``
            (:class:`~vlmspec.scores.TokenScores`, ``[T, V]`` each); else ``None``.
        reasoning: a thinking model's reasoning, the text before ``</think>``, when the pipeline has a reasoning
            parser and the reply opens in reasoning (:mod:`vlmspec.reasoning`); else ``None``.
        content: the answer: the text after the reasoning (all of ``text`` when there is no reasoning).
    """

    text: str
    token_ids: list[int]
    stats: SpecStats
    scores: TokenScores | None = None
    reasoning: str | None = None
    content: str | None = None


@dataclass
class DraftPrompt:
    """How the draft sees the prompt.

    Attributes:
        adapter: the draft model's adapter.
        inputs: processor outputs on the draft's device (the same prompt as the target's).
        select: maps the target prefill's ``visual_scores`` (or ``None``) to the prompt positions the draft keeps
            (``None``: all); ``None`` disables pruning.
        needs_scores: whether ``select`` needs the target's attention scores over the visual tokens.
        vocab: the ids the draft may propose and embed (:class:`~vlmspec.draft.DraftVocab`); ``None``: all.
    """

    adapter: VLMAdapter
    inputs: dict[str, torch.Tensor]
    select: Callable[[torch.Tensor | None], torch.Tensor | None] | None = None
    needs_scores: bool = False
    vocab: DraftVocab | None = None

    @classmethod
    def pruned(
        cls, adapter: VLMAdapter, inputs: dict[str, Any], pruning: Any, vocab: DraftVocab
    ) -> DraftPrompt:
        """The draft's view of ``inputs`` (on its device) under ``pruning`` (a
        :class:`~vlmspec.pruning.PruningConfig`)."""
        inputs = on_device(inputs, adapter.device)
        select = pruning.draft_selection(adapter, inputs)
        return cls(adapter, inputs, select, select is not None and pruning.needs_scores, vocab)


@torch.inference_mode()
def speculative_generate(
    target: VLMAdapter,
    target_inputs: dict[str, torch.Tensor],
    policy: TreePolicy,
    stop: StopCriteria,
    draft: DraftPrompt | None = None,
    sampling: SamplingParams | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    processing: LogitsProcessing | NodeProcessing | None = None,
    scores: ScoreLog | None = None,
    grammar: Grammar | None = None,
) -> tuple[list[int], SpecStats]:
    """Generate with tree speculative decoding: greedy, or sampling from the target's own distribution.

    Args:
        target: adapter of the target model.
        target_inputs: processor outputs (batch 1) on the target's device.
        policy: the tree policy; ``policy.uses_draft`` False means plain autoregressive decoding.
        stop: stop criteria (EOS ids, stop strings, ``max_new_tokens``), as ``generate()`` applies them.
        draft: the draft model and how to prefill it; required when ``policy.uses_draft``.
        sampling: ``None`` for greedy decoding, else the sampling settings (``generate(do_sample=True)``'s).
        on_tokens: called with the tokens each step emits (the prefill's first token, then each step's accepted
            tokens and bonus token together), once they are final: never a token that is later taken back.
        processing: ``generate()``'s sequence-dependent logits processors (repetition penalty, minimum length,
            suppressed tokens; or transformers' whole list, :mod:`vlmspec.node_processors`), applied to the
            target's logits of every node before any token is chosen.
        scores: keeps the target's logits and scores behind each emitted token (``output_scores``), if given.
        grammar: the structure the reply follows (structured outputs, :mod:`vlmspec.structured`): it masks the
            target's logits after ``processing``, and the draft's, at every node.

    Returns:
        The generated token ids (EOS included when produced, like ``generate()``) and the statistics.
    """
    stats = SpecStats(policy=policy.name, lossless=policy.lossless)
    stop = stop.after_prompt(target_inputs["input_ids"][0])  # a stop string may begin in the prompt
    sampler = Sampler(sampling, sampling.generator(target.device)) if sampling is not None else None
    policy.begin(sampler)
    t_start = time.perf_counter()
    clock = StageClock(target.device)  # per-stage seconds (device events on a GPU: no sync in the loop)

    # 1. Prefill the target on the full prompt; its argmax is the first new token (the first root). A draft that
    #    reads the target's hidden states (EDD) gets them from this forward and from each verification.
    uses_draft = policy.uses_draft and draft is not None
    read_layer = draft.adapter.reads_target_layer if uses_draft else None
    prefill = target.prefill(
        target_inputs, score_visual=uses_draft and draft.needs_scores, hidden_layer=read_layer
    )
    t_state = prefill.state
    logits, processed = prefill.logits, None  # [V]
    if processing is not None:
        processed = processing.start(target_inputs["input_ids"][0], logits.shape[-1])
        logits = processed.first(logits)
    guide = grammar.start() if grammar is not None else None
    if guide is not None:
        logits = guide.first(logits)
    if scores is not None:
        scores.add(prefill.logits[None], logits[None])
    root = logits.argmax() if sampler is None else sampler.sample(logits)  # []
    position = target_inputs["input_ids"].shape[1]  # logical position of the root: the prompt's length
    stats.prompt_tokens, stats.cached_prompt_tokens = position, prefill.cached
    stats.target_visual_tokens = t_state.visual_tokens
    clock.lap("prefill")

    # 2. Prefill the draft (its own, possibly pruned, view of the prompt).
    d_state, pending = _prefill_draft(policy, draft, prefill, stats)
    if d_state is not None:
        clock.lap("draft_prefill")

    tokens: list[int] = []
    done = _emit([int(root)], tokens, stop, scores, on_tokens)
    if processed is not None:
        processed.commit(root.reshape(1))
    if guide is not None:
        guide.commit(tokens)
    clock.lap("emit")  # the first token's (each step's own emission is in its verify lap)
    t_dtype = target.dtype  # read once: through a request's adapter views it is an attribute chain
    while not done:
        # 3. Draft a tree (the policy decides its shape); never deeper than the tokens still wanted.
        if d_state is not None:
            limit = stop.max_new_tokens - len(tokens) - 1
            builder = draft_tree(
                draft.adapter, d_state, root, position, pending, limit, vocab=draft.vocab, constraint=guide
            )
            tree = policy.build_tree(builder)
        else:
            builder, tree = None, TokenTree.root_only(root)
        clock.lap("draft")

        # 4. Verify every node in one target forward under the tree mask.
        past = t_state.length
        verify = (tree.tokens, tree.positions(position), tree.attention_bias(past, t_dtype))
        if read_layer is None:
            raw = logits = target.forward(t_state, *verify)  # [N+1, V]
        else:
            raw, hidden = target.forward_hidden(t_state, *verify, read_layer)  # [N+1, V], [N+1, D]
            logits = raw
        # generate()'s processors on each node's logits, with the sequence that node ends
        if processed is not None:
            logits = processed.tree(logits, tree, len(tokens))
        if guide is not None:  # the structure's masks come after, as a logits_processor list does
            logits = guide.tree(logits, tree)

        # 5. Accept a path and the target's next token (greedy: the longest path matching the target's argmax;
        #    sampling: the same walk following one draw from the target's warped distribution per node).
        acc = policy.accept(tree, logits, sampler)
        path, new, draft_slots = read_step(acc, tree, builder)  # the step's one host sync
        a = len(path)  # root + accepted nodes
        on_path = acc.order[:a]  # [a] the path on the device

        # 6. Keep the accepted path in both caches, drop the rest of the tree.
        if path == list(range(a)):  # the first `a` verified tokens (always for ar and chains): crop the rest
            truncate(t_state.cache, past + a)
        else:
            keep_tail(t_state.cache, past, past + on_path)  # cache slots of the root and the accepted nodes
        if builder is not None:
            soft_prompt = hidden[on_path] if read_layer is not None else None
            pending = builder.commit(tree.source_ids[on_path], draft_slots, soft_prompt)
        if processed is not None:
            processed.commit(torch.cat([tree.tokens[on_path[1:]], acc.next_token.reshape(1)]))

        # 7. Feed the statistics back to the policy.
        policy.feedback(StepFeedback(step=stats.steps, accepted=a - 1, tree_size=tree.num_nodes))
        # 8. Emit the tokens, applying the stop conditions after each one as generate() does.
        if scores is not None:  # token i was chosen from the distribution at the path's node i
            scores.add(raw[on_path], logits[on_path])
        before = len(tokens)
        done = _emit(new, tokens, stop, scores, on_tokens)
        if guide is not None and not done:
            guide.commit(new)
        # Statistics count only accepted tokens that were emitted (a stop condition may cut the step short).
        _count_step(stats, policy, tree.num_nodes, min(a - 1, len(tokens) - before))
        root = acc.next_token
        position += a
        clock.lap("verify")

    _finish(stats, clock.read(), len(tokens), time.perf_counter() - t_start)
    return tokens, stats


def _prefill_draft(
    policy: TreePolicy, draft: DraftPrompt | None, prefill: Any, stats: SpecStats
) -> tuple[DecodeState | None, torch.Tensor | None]:
    """Step 2: the draft's state after its prefill (``None`` without a draft) and what it has not consumed yet:
    accepted tokens ``[p]``, or for an EDD draft their target hidden states ``[p, D]`` (none so far)."""
    if not policy.uses_draft:
        return None, None
    if draft is None:
        raise InvalidInputError(f"policy {policy.name!r} needs a draft model, but the pipeline has none")
    if draft.adapter.reads_target_layer is None:
        keep = draft.select(prefill.visual_scores) if draft.select is not None else None
        d_state = draft.adapter.prefill(draft.inputs, keep=keep).state
        pending = prefill.logits.new_zeros(0, dtype=torch.long)
    else:  # the soft prompt: the target's hidden states of the whole prompt, at its rotary positions
        d_state = draft.adapter.prefill_soft(
            prefill.hidden, prefill.position_ids, prefill.state.rope_delta, target=prefill.state
        )
        pending = prefill.hidden.new_zeros(0, prefill.hidden.shape[-1])
    stats.draft_visual_tokens = d_state.visual_tokens
    return d_state, pending


def _emit(
    new: list[int],
    tokens: list[int],
    stop: StopCriteria,
    scores: ScoreLog | None,
    on_tokens: Callable[[list[int]], None] | None,
) -> bool:
    """Append ``new`` to ``tokens`` one at a time, checking the stop conditions after each as ``generate()`` does;
    hand the ones emitted to ``on_tokens``. Returns whether generation is done."""
    before, done = len(tokens), False
    for token in new:
        tokens.append(token)
        done = stop.update(tokens, scores)
        if done:
            break
    if on_tokens is not None:
        on_tokens(tokens[before:])
    if scores is not None:
        scores.keep(len(tokens))
    return done


def _count_step(stats: SpecStats, policy: TreePolicy, tree_size: int, accepted: int) -> None:
    """Add one verification step to the statistics."""
    stats.trace.append({**policy.trace(), "tree_size": tree_size, "accepted": accepted})
    stats.steps += 1
    stats.accepted_tokens += accepted
    stats.tree_sizes.append(tree_size)


def _finish(stats: SpecStats, seconds: dict[str, float], new_tokens: int, total_seconds: float) -> None:
    """The statistics of the whole call, once it ended."""
    stats.total_seconds = total_seconds
    stats.prefill_seconds, stats.draft_prefill_seconds = seconds["prefill"], seconds["draft_prefill"]
    stats.draft_seconds, stats.verify_seconds = seconds["draft"], seconds["verify"]
    stats.new_tokens = new_tokens
    stats.mean_accepted = stats.accepted_tokens / max(stats.steps, 1)
    stats.tokens_per_step = (new_tokens - 1) / max(stats.steps, 1)
    stats.tokens_per_second = new_tokens / max(total_seconds, 1e-9)


def read_step(
    acc: Acceptance, tree: TokenTree, builder: DraftTree | None
) -> tuple[list[int], list[int], list[int]]:
    """The one host sync a step needs: what the target accepted decides the tokens to emit and what the caches keep.

    Args:
        acc: the step's acceptance (``order`` ``[N+1]``, ``length``/``next_token`` ``[]``), on the device.
        tree: the verified tree, ``N + 1`` nodes (``tokens``, ``source_ids``: ``[N+1]``).
        builder: the step's draft tree (its cache slots per node), ``None`` without a draft.

    Returns:
        ``path``: the accepted path's tree indices (root first); ``new``: the tokens to emit (the path's tokens
        after the root, then the bonus token); ``draft_slots``: where the path's nodes sit in the draft cache
        (``-1``: not forwarded; empty without a draft).
    """
    order = acc.order  # [N+1], the path first
    parts = [acc.length.reshape(1), order, tree.tokens[order], acc.next_token.reshape(1)]
    if builder is not None:
        parts.append(builder.cache_slots(tree.source_ids[order]))
    host = torch.cat(parts).tolist()
    a, width = host[0], order.shape[0]
    path, tokens = host[1 : 1 + a], host[1 + width : 1 + width + a]
    draft_slots = host[2 + 2 * width : 2 + 2 * width + a]
    return path, tokens[1:] + [host[1 + 2 * width]], draft_slots
