"""Structured outputs: replies that follow a JSON schema, a regular expression, a list of choices or a grammar,
decoded through the token tree and still the target's own.

A request's :class:`StructuredOutputs` (vLLM's ``StructuredOutputsParams``; OpenAI's ``response_format`` in
``vlmspec serve``) is compiled by xgrammar, vLLM's and SGLang's default backend, against the pair's tokenizer into
a token-level automaton (:func:`compile_structured`). The request keeps one ``GrammarMatcher`` over the tokens it
emits (:class:`GrammarGuide`), and masks logits in two places:

* **The target's.** Every verified node's logits get ``-inf`` at each token the grammar forbids after that node's
  sequence: the tokens emitted so far, then the node's path below the root. xgrammar's ``traverse_draft_tree``
  (SGLang's way for EAGLE trees) walks the tree depth first, accepting each node's token and rolling it back, so
  one pass gives every node's mask. A node the grammar rejects cannot be accepted (its token has probability 0
  under its parent's mask), and no reply goes on after a stop token, so the rows of such nodes are left unmasked. The reply is the target's own under these masks:
  ``generate()`` with xgrammar's logits processor (``xgrammar.contrib.hf.LogitsProcessor``, after ``generate()``'s
  own processors, as a ``logits_processor`` list is), greedy token for token, sampled by the same law (the masks
  are a logits processor, and sampling after processors is lossless, :mod:`vlmspec.verify`).
* **The draft's.** The draft's distribution at every node it expands is masked the same way, so it proposes only
  tokens the grammar allows: where the grammar forces a token (a key of the schema, a closing brace) the draft
  proposes exactly it and the target accepts it. The draft only proposes, so this changes speed, not output.

The matcher runs on the host: each draft forward and each verification reads its tree's tokens there (a host
sync the masks need), paid only by requests with structured outputs.

Choices where vLLM leaves them open, made the same way as vLLM's xgrammar backend: a JSON schema is compiled in
xgrammar's strict mode (no properties beyond the schema's unless it allows them) with any whitespace between
tokens; ``disable_any_whitespace`` allows none beyond one space after ``:`` and ``,`` (vLLM's option of that name:
a small model can loop on newlines where whitespace is free); ``json_object`` is any JSON object; ``choice`` is
the grammar ``root ::= "a" | "b" | ...``. The reply ends with one of the request's EOS ids once the grammar is
complete (the EOS ids are the grammar's stop tokens), so a request with structured outputs needs one.
"""

from __future__ import annotations

import dataclasses
import json as json_module
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .draft import logits_width
from .errors import InvalidInputError
from .reasoning import ReasoningParser
from .stopping import eos_token_ids
from .structured_outputs import StructuredOutputs

COMPILED_CACHE_BYTES = 2**28
"""The most memory a tokenizer's compiled grammars are kept in (xgrammar's LRU; a server sees many schemas)."""
_COMPILERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = (
    weakref.WeakKeyDictionary()
)
_COMPILERS_LOCK = threading.Lock()


def _compiler(tokenizer: Any, width: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's compiler for ``tokenizer`` over ``width`` logits with ``stop_ids`` ending a complete reply,
    made once per tokenizer and kept while it lives (its own cache keeps the grammars it compiled)."""
    import xgrammar

    with _COMPILERS_LOCK:
        made = _COMPILERS.setdefault(tokenizer, {})
        if (width, stop_ids) not in made:
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=width, stop_token_ids=list(stop_ids)
            )
            made[width, stop_ids] = xgrammar.GrammarCompiler(info, cache_limit_bytes=COMPILED_CACHE_BYTES)
        return made[width, stop_ids]


def compile_structured(
    spec: StructuredOutputs, tokenizer: Any, width: int, stop_ids: Sequence[int]
) -> Grammar:
    """``spec`` compiled for a pair whose tokenizer is ``tokenizer`` and whose target gives ``width`` logits, the
    reply ending with one of ``stop_ids`` (the request's EOS ids).

    Raises:
        InvalidInputError: no EOS id, or a schema, expression or grammar xgrammar cannot compile (its message).
        ImportError: xgrammar is not installed.
    """
    if not stop_ids:
        raise InvalidInputError(
            "structured_outputs needs an EOS token to end the reply once it is complete, but this request has "
            "none (eos_token_id=[]); leave eos_token_id unset, or give one"
        )
    try:
        import xgrammar  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "structured_outputs need xgrammar, a dependency of vlmspec: pip install 'xgrammar>=0.2.8'"
        ) from error
    compiler = _compiler(tokenizer, width, tuple(stop_ids))
    any_whitespace = not spec.disable_any_whitespace
    try:
        if spec.json is not None:
            compiled = compiler.compile_json_schema(spec.json, any_whitespace=any_whitespace)
        elif spec.json_object:
            compiled = compiler.compile_json_schema(
                '{"type": "object"}', strict_mode=False, any_whitespace=any_whitespace
            )
        elif spec.regex is not None:
            compiled = compiler.compile_regex(spec.regex)
        elif spec.choice is not None:
            # literal characters (no \u escapes: xgrammar reads each half of a surrogate pair as a character)
            literals = (json_module.dumps(choice, ensure_ascii=False) for choice in spec.choice)
            compiled = compiler.compile_grammar("root ::= " + " | ".join(literals))
        else:
            compiled = compiler.compile_grammar(spec.grammar)
    except RuntimeError as error:  # xgrammar's parsers and converters raise it with their message
        reason = re.sub(r"^\[[\d:]+\] \S+: ", "", str(error).strip())
        value = getattr(spec, spec.kind)
        raise InvalidInputError(
            f"structured_outputs.{spec.kind}={value!r:.80} cannot be compiled: {reason:.300}"
        ) from None
    return Grammar(compiled, width)


def generate_processor(
    spec: StructuredOutputs | Mapping[str, Any],
    tokenizer: Any,
    target: Any,
    reasoning: ReasoningParser | None = None,
) -> Any:
    """xgrammar's logits processor for ``target.generate(logits_processor=[...])`` under ``spec``: structured
    outputs as a user runs them without vlmspec, and what a structured reply equals (one per ``generate()``).
    For a reply that opens in ``reasoning`` (:func:`~vlmspec.reasoning.reply_reasoning`), the structure applies
    after its end tag (:class:`AfterReasoning`)."""
    import xgrammar.contrib.hf

    grammar = compile_structured(
        StructuredOutputs.of(spec), tokenizer, logits_width(target), eos_token_ids(target)
    ).after(reasoning, tokenizer)
    if grammar.reasoning_end is not None:
        return AfterReasoning(grammar)
    return xgrammar.contrib.hf.LogitsProcessor(grammar.compiled)


class AfterReasoning:
    """A ``generate()`` logits processor (batch 1) that leaves the logits alone until the reply emits
    ``grammar.reasoning_end`` (``</think>``), then masks them with ``grammar`` over the tokens after it: what a reply
    that opens in reasoning under a structure equals (:mod:`vlmspec.reasoning`)."""

    def __init__(self, grammar: Grammar) -> None:
        self.guide = grammar.start()
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        else:
            self.guide.commit(input_ids[0, -1:].tolist())
        return self.guide.first(scores[0])[None]


@dataclass(frozen=True)
class Grammar:
    """A compiled :class:`StructuredOutputs`, shared by requests; :meth:`start` gives one request's guide.

    Attributes:
        compiled: xgrammar's ``CompiledGrammar``.
        width: the target's logits width (the masks' last dimension).
    """

    compiled: Any
    width: int
    reasoning_end: int | None = None
    """The token that ends the reasoning the reply opens in (:mod:`vlmspec.reasoning`): the structure applies
    after it; ``None``: from the reply's first token."""

    def start(self) -> GrammarGuide:
        return GrammarGuide(self)

    def after(self, reasoning: ReasoningParser | None, tokenizer: Any) -> Grammar:
        """This grammar for a reply that opens in ``reasoning`` (``None``: one that does not: as it is), applied
        after its end tag, which must be one token of ``tokenizer``."""
        if reasoning is None:
            return self
        return dataclasses.replace(self, reasoning_end=reasoning.end_token(tokenizer))


_BITS = torch.arange(32, dtype=torch.int32)


class GrammarGuide:
    """One request's place in its grammar: the tokens it emitted so far (:meth:`commit`), and the masks of the
    logits after them (:meth:`first`, :meth:`tree`) and after any draft node (:meth:`allowed`)."""

    def __init__(self, grammar: Grammar) -> None:
        import xgrammar

        self.grammar = grammar
        self.matcher = xgrammar.GrammarMatcher(grammar.compiled)
        self.reasoning = grammar.reasoning_end is not None
        """Whether the reply is still reasoning: the matcher waits, unmoved, for the tokens after it."""

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's ``[V]`` logits (or the next token's), masked: the first new token's."""
        if self.reasoning:
            return logits
        return self._masked(logits[None], self._bitmask(torch.zeros(1, dtype=torch.long), [-1]))[0]

    def tree(self, logits: torch.Tensor, tree: Any) -> torch.Tensor:
        """A verification's ``[N+1, V]`` logits, masked: each node's with the grammar after its path (after the
        reasoning's end on it, while the reply reasons; a node still reasoning is left alone)."""
        if self.reasoning:
            bitmask = self._after_reasoning_bitmask(tree.tokens, tree.parents)
            return logits if bitmask is None else self._masked(logits, bitmask)
        return self._masked(logits, self._tree_bitmask(tree.tokens, tree.parents))

    def allowed(self, tokens: torch.Tensor, parents: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``[k, V]`` bool, the tokens the grammar allows after each of ``nodes`` ``[k]`` of a draft tree whose
        nodes have ``tokens`` and ``parents`` ``[n]`` (node 0, the root, already emitted).

        Only the nodes asked for are walked, each along its path (accepted, its mask filled, rolled back): a draft
        tree holds far more candidates than the draft expands (EAGLE-2's: hundreds), so walking the whole tree at
        every level would cost its size each time. A node the grammar rejects, or past a stop token, allows all.

        While the reply reasons, every node allows all, with no host read: the structure only starts below a
        ``</think>`` the draft itself proposes, which is rare, and the draft only proposes (the verification's
        masks, :meth:`tree`, keep the reply the target's), so masking it there would cost a host sync at every
        draft level of a long reasoning to spare a few rejected proposals.
        """
        import xgrammar

        if self.reasoning:
            return torch.ones(nodes.shape[0], self.grammar.width, dtype=torch.bool, device=tokens.device)
        n = tokens.shape[0]
        host = torch.cat([tokens, parents, nodes]).tolist()  # one host read
        token_of, parent_of = host[:n], host[n : 2 * n]
        bitmask = xgrammar.allocate_token_bitmask(len(host) - 2 * n, self.grammar.width)  # all allowed
        for row, node in enumerate(host[2 * n :]):
            path = []
            while node > 0:
                path.append(token_of[node])
                node = parent_of[node]
            accepted = 0
            while accepted < len(path) and self.matcher.accept_token(path[-1 - accepted]):
                accepted += 1
            if accepted == len(path) and not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(bitmask, row)
            if accepted:
                self.matcher.rollback(accepted)
        return _unpack(bitmask.to(tokens.device), self.grammar.width)

    def commit(self, tokens: list[int]) -> None:
        """Move past emitted ``tokens``.

        Raises:
            InvalidInputError: a token the grammar forbids: the call's other processors (``min_new_tokens``,
                suppressed tokens, ``logit_bias``) left the target no token the grammar allows.
        """
        if self.reasoning:
            if self.grammar.reasoning_end not in tokens:
                return
            self.reasoning = False
            tokens = tokens[tokens.index(self.grammar.reasoning_end) + 1 :]
        for token in tokens:
            if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                raise InvalidInputError(
                    f"structured_outputs: the target emitted token {token}, which the structure forbids there, "
                    "because the call's other settings (min_new_tokens, suppressed tokens, logit_bias, ...) "
                    "banned every token it allows; drop the setting that conflicts with the structure"
                )

    def _tree_bitmask(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """``[n, W]`` int32 xgrammar bitmask of a tree of ``n`` nodes (``parents[0] = -1``), one host read."""
        host = torch.stack([tokens, parents]).cpu()
        return self._bitmask(host[0], host[1].tolist())

    def _after_reasoning_bitmask(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor | None:
        """:meth:`_tree_bitmask` while the reply reasons: each node whose path ends the reasoning (its first
        ``reasoning_end``, at node ``e``) is masked as the grammar's walk of ``e``'s subtree from its start (the
        matcher has not moved yet); the other nodes are all allowed. ``None`` when no node ends the reasoning
        (the usual verification of a long reasoning): nothing to mask, no ``[N+1, V]`` mask built."""
        import xgrammar

        token_of, parent_of = torch.stack([tokens, parents]).tolist()  # one host read
        n, end = len(token_of), self.grammar.reasoning_end
        ends = [-1] * n  # the node whose token ends the reasoning on each node's path, -1: none
        for node in range(1, n):  # parents come before their children
            above = ends[parent_of[node]]
            ends[node] = above if above >= 0 else (node if token_of[node] == end else -1)
        if max(ends) < 0:
            return None
        bitmask = xgrammar.allocate_token_bitmask(n, self.grammar.width)  # all allowed
        for top in (node for node in range(n) if ends[node] == node):
            below = [node for node in range(n) if ends[node] == top]  # top first, in topological order
            local = {node: i for i, node in enumerate(below)}
            sub_parents = [local.get(parent_of[node], -1) for node in below]
            sub_tokens = torch.tensor([token_of[node] for node in below])
            bitmask[below] = self._bitmask(sub_tokens, sub_parents)
        return bitmask

    def _bitmask(self, tokens: torch.Tensor, parents: list[int]) -> torch.Tensor:
        import xgrammar

        n = len(parents)
        first_child, next_sibling = [-1] * n, [-1] * n
        for node in range(n - 1, 0, -1):  # children in id order: each is its parent's first before its elder
            parent = parents[node]
            next_sibling[node], first_child[parent] = first_child[parent], node
        bitmask = xgrammar.allocate_token_bitmask(n, self.grammar.width)  # all allowed
        self.matcher.traverse_draft_tree(
            torch.tensor(first_child), torch.tensor(next_sibling), tokens.long(), bitmask
        )
        if not bitmask[0].any():  # the root's row: where the reply is now
            raise InvalidInputError(
                "structured_outputs allows no reply here: its grammar has no token after what was emitted (e.g. "
                "a rule that only refers to itself); check the grammar"
            )
        # a node past the reply's end (after a stop token) allows nothing: it is never decoded from, and its row
        # is left whole so that every row stays a distribution
        bitmask[(bitmask == 0).all(dim=1)] = -1
        return bitmask

    def _masked(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        allowed = _unpack(bitmask.to(logits.device), logits.shape[-1])
        return logits.masked_fill(~allowed, float("-inf"))


def _unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, W]`` int32 bitmask (bit ``j`` of word ``i``: token ``32 i + j``) as ``[n, width]`` bool."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1
    return bits.flatten(1)[:, :width].bool()
