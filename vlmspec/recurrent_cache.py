"""Recurrent layers' states in a :class:`~vlmspec.cache.KVStore`: the other half of a hybrid model's cache.

Qwen3.5's language model (and Qwen3.5-MoE's) interleaves attention layers with Gated DeltaNet layers, which keep no
keys: each carries a recurrent state ``[H, Dk, Dv]`` from token to token, and a short causal convolution reads the
last ``K`` inputs of its projections. LFM2's (LFM2-VL's) recurrent layers are such convolutions alone. transformers carries both along the sequence, one token after the other, and
cannot cut them back (its assisted generation refuses these models). A tree cannot be run that way: its nodes are
not one sequence, and only one path of it is kept.

What vlmspec keeps instead, per row (request) and per recurrent layer:

- the **committed** state: the recurrent state after the row's first ``base`` entries, and the convolution inputs
  of its last ``K - 1`` entries;
- every **pending** entry's own state and convolution input: the entries fed since the last commit (a draft's
  levels, a verified tree). An entry's recurrent state is its parent's advanced by one token, its convolution
  window its ancestors' inputs and its own, where its ancestors are exactly the earlier entries its attention mask
  lets it see (a tree mask is an ancestors mask; the committed entries are seen by all), and its parent the last of
  them. So a forward needs nothing but the mask the attention layers get (:func:`tree_links`).

Keeping a path (:meth:`RecurrentRows.keep_row`, called by the store's own) makes the state of the path's last entry
the committed one and the path's last ``K - 1`` inputs the convolution's; nothing is recomputed. The price is
memory: a pending entry holds a whole state (``H x Dk x Dv`` floats per layer) until the next commit, so a tree of
``N`` nodes costs ``N`` states per recurrent layer while it is verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionLayer

_SPARE = 64  # pending entries allocated past a row's need


class RecurrentRows:
    """The recurrent layers' states of up to ``max_rows`` requests of one model (live rows ``0 .. rows-1``).

    Buffers, one tensor for all recurrent layers (row moves are one copy):

    - ``conv``: ``[layers, max_rows, K - 1 + P, C]`` convolution inputs; entry ``s`` of row ``b`` at
      ``s - base[b] + K - 1`` (the committed last ``K - 1``, then the pending ones);
    - ``state``: ``[layers, max_rows, 1 + P, H, Dk, Dv]`` recurrent states; the state after entry ``s`` at
      ``s - base[b] + 1`` (the committed one at 0).

    Args:
        max_rows: the most requests held at once.
        layers: the model's indices of its recurrent layers, in order.
    """

    def __init__(self, max_rows: int, layers: list[int]) -> None:
        self.max_rows = max_rows
        self.index = {layer: i for i, layer in enumerate(layers)}  # model layer -> buffer row
        self.conv = torch.empty(0)
        self.state = torch.empty(0)
        self.kernel = 0  # K: the convolution's width
        self.stateful = True  # False: convolutions alone (LFM2), their state buffer empty
        self.base: list[int] = []  # committed entries of each live row

    @property
    def pending(self) -> int:
        """Pending entries each row has room for."""
        return self.state.shape[2] - 1

    def add_row(self, layers: list[LinearAttentionLayer], length: int) -> None:
        """A new row from a prefill's recurrent layers (batch 1), after ``length`` prompt entries."""
        # [R, C, K]: transformers keeps the last K inputs (K - 1 are read by the next token's window)
        conv = torch.stack([layer.conv_states[0][0] for layer in layers])
        states = [layer.recurrent_states[0] for layer in layers]
        # [R, H, Dk, Dv], or [R, 0] for layers of convolutions alone
        state = conv.new_zeros(len(layers), 0) if states[0] is None else torch.stack([s[0] for s in states])
        kernel = conv.shape[-1]
        if self.conv.numel() == 0:
            self.stateful = states[0] is not None
            r, channels = conv.shape[:2]
            self.kernel = kernel
            self.conv = conv.new_zeros(r, self.max_rows, kernel - 1 + _SPARE, channels)
            self.state = state.new_zeros(r, self.max_rows, 1 + _SPARE, *state.shape[1:])
        row = len(self.base)
        self.conv[:, row, : kernel - 1] = conv[:, :, 1:].transpose(1, 2)
        self.state[:, row, 0] = state
        self.base.append(length)

    def remove_row(self, row: int) -> None:
        """Free ``row``; the last live row moves into its place (as the store's rows do)."""
        last = len(self.base) - 1
        if row != last:
            self.conv[:, row] = self.conv[:, last]
            self.state[:, row] = self.state[:, last]
            self.base[row] = self.base[last]
        self.base.pop()

    def reserve(self, entries: int) -> None:
        """Room for ``entries`` pending entries per row (doubling, so growing is rare)."""
        if entries <= self.pending:
            return
        size = max(entries + _SPARE, 2 * self.pending)
        kernel = self.kernel
        conv = self.conv.new_zeros(*self.conv.shape[:2], kernel - 1 + size, self.conv.shape[3])
        state = self.state.new_zeros(*self.state.shape[:2], 1 + size, *self.state.shape[3:])
        conv[:, :, : self.conv.shape[2]] = self.conv
        state[:, :, : self.state.shape[2]] = self.state
        self.conv, self.state = conv, state

    def keep_row(self, row: int, start: int, keep: torch.Tensor) -> None:
        """Row ``row`` keeps its first ``start`` entries and then the entries ``keep`` (ascending, ``>= start``):
        the state after the last of them becomes the committed one, their last ``K - 1`` inputs the convolution's.

        Entries before ``start`` that are still pending (fed since the last commit) are kept as they are.
        """
        base, kernel = self.base[row], self.kernel
        if start < base:
            raise RuntimeError(
                f"recurrent layers cannot go back before their committed {base} entries to {start}"
            )
        tail = torch.arange(start - kernel + 1, start, device=keep.device)
        kept = torch.cat([tail, keep])  # [K-1+k] entries, the last K-1 of them kept
        conv = self.conv[:, row].index_select(1, kept[-(kernel - 1) :] - base + kernel - 1)  # [R, K-1, C]
        state = self.state[:, row, kept[-1] - base + 1]  # [R, H, Dk, Dv]
        self.conv[:, row, : kernel - 1] = conv
        self.state[:, row, 0] = state
        self.base[row] = start + keep.shape[0]

    def committed(self, row: int) -> list[LinearAttentionLayer]:
        """Row ``row``'s committed states as transformers' layers (one per recurrent layer, batch 1): what a prefill
        leaves, so that the row can be copied out, extended by a prompt or put into another store."""
        kernel = self.kernel
        return [
            transformers_layer(
                torch.nn.functional.pad(conv[: kernel - 1].T[None], (1, 0)),
                state[None] if self.stateful else None,
            )
            for conv, state in zip(self.conv[:, row], self.state[:, row, 0], strict=True)
        ]

    def convolved(
        self, links: TreeLinks, index: int, inputs: torch.Tensor, conv: torch.nn.Conv1d
    ) -> torch.Tensor:
        """Layer ``index``'s causal convolution ``[B*n, C]`` (before any activation) of a forward's ``[B, n, C]``
        new entries, each over its window: its last ``K - 1`` ancestors' inputs, then its own (``inputs``, written
        to the buffer as the entries' own). ``conv``: the layer's depthwise ``Conv1d`` (weight ``[C, 1, K]``)."""
        buffer = self.conv[self.index[index]]  # [max_rows, K-1+P, C]
        row = links.rows[:, None]  # [B, 1]
        buffer[row, links.write_conv] = inputs.to(buffer.dtype)
        window = buffer[row[..., None], links.window]  # [B, n, K, C]
        weight = conv.weight
        out = torch.nn.functional.conv1d(
            window.flatten(0, 1).transpose(1, 2).to(weight.dtype), weight, conv.bias, groups=weight.shape[0]
        )
        return out[..., -1]  # [B*n, C]: one output per window


def transformers_layer(conv: torch.Tensor, state: torch.Tensor | None) -> LinearAttentionLayer:
    """A recurrent layer's cache as transformers keeps it, holding copies of ``conv`` ``[1, C, K]`` (the last ``K``
    convolution inputs) and ``state`` ``[1, H, Dk, Dv]`` (``None``: a layer of convolutions alone)."""
    layer = LinearAttentionLayer()
    layer.update_conv_state(conv.clone(), conv_kernel_size=conv.shape[-1])
    if state is not None:
        layer.update_recurrent_state(state.clone())
    return layer


def copied(layer: LinearAttentionLayer) -> LinearAttentionLayer:
    """A copy of a recurrent layer's cache (its last convolution inputs and its state)."""
    return transformers_layer(layer.conv_states[0], layer.recurrent_states[0])


@dataclass
class Checkpoint:
    """A hybrid model's recurrent states after its first ``length`` cache entries (a prompt's end), kept so that a
    later prompt sharing that much can start from there: everything else about a cache can be cut back, these
    states cannot.

    Attributes:
        length: the entries they follow.
        layers: copies of the recurrent layers' states, as transformers keeps them.
    """

    length: int
    layers: list[LinearAttentionLayer]


@dataclass
class TreeLinks:
    """How the entries of one forward hang together in the recurrent layers (the same for every layer).

    Attributes:
        rows: ``[B]`` the store rows of the forward's rows.
        write_conv: ``[B, n]`` where each new entry's convolution input goes (in its row's ``conv`` buffer).
        window: ``[B, n, K]`` the convolution window of each new entry: its last ``K - 1`` ancestors' inputs, then
            its own (indices in its row's ``conv`` buffer).
        write_state: ``[B, n]`` where each new entry's state goes (in its row's ``state`` buffer).
        parent_state: ``[B, n]`` where the state it advances from lies (its parent's).
        levels: per level, ``[m]`` flat indices (``b * n + j``) of the new entries whose parents lie at the level
            before (level 0: parents fed before this forward); padding entries are in none.
    """

    rows: torch.Tensor
    write_conv: torch.Tensor
    window: torch.Tensor
    write_state: torch.Tensor
    parent_state: torch.Tensor
    levels: list[torch.Tensor]


def tree_links(
    recurrent: RecurrentRows, rows: list[int], lengths: list[int], counts: list[int], bias: torch.Tensor
) -> TreeLinks:
    """The :class:`TreeLinks` of a forward of ``n`` entries per row, read off its attention mask.

    Args:
        recurrent: the model's recurrent rows.
        rows: the store rows of the forward's ``B`` rows.
        lengths: their entries before the forward.
        counts: how many of the ``n`` entries of each row are real (the rest are padding, written past the row's
            length and never read).
        bias: ``[B, 1, n, keys]`` the additive attention mask of the forward (0: seen).
    """
    n, keys = bias.shape[2], bias.shape[3]
    device, kernel = bias.device, recurrent.kernel
    bases = [recurrent.base[row] for row in rows]
    recurrent.reserve(max(length + n - first for length, first in zip(lengths, bases, strict=True)))
    base = torch.tensor(bases, device=device)[:, None]  # [B, 1]
    start = torch.tensor(lengths, device=device)[:, None]  # [B, 1]
    slot = start + torch.arange(n, device=device)  # [B, n] the new entries
    low = max(min(bases) - kernel + 1, 0)
    key = torch.arange(low, keys, device=device)  # [W] the keys that may be in a window
    earlier = (bias[:, 0, :, low:] == 0) & (key < slot[..., None])  # [B, n, W] seen, before the entry
    found = torch.where(earlier, key, -1)
    if found.shape[-1] < kernel - 1:  # a prompt shorter than the window
        found = torch.nn.functional.pad(found, (kernel - 1 - found.shape[-1], 0), value=-1)
    # [B, n, K-1] the last K-1 ancestors, ascending (-1: before the sequence, the zeros a prompt starts from)
    ancestors = found.topk(kernel - 1, dim=-1).values.flip(-1)
    last_conv, last_state = recurrent.pending + kernel - 2, recurrent.pending  # the buffers' last indices
    window = torch.cat([ancestors, slot[..., None]], -1) - base[..., None] + kernel - 1
    parent = (ancestors[..., -1] - base + 1).clamp(0, last_state)
    level = (earlier & (key >= start[..., None])).sum(-1)  # [B, n] ancestors among the new entries
    real = torch.arange(n, device=device) < torch.tensor(counts, device=device)[:, None]
    flat = torch.where(real, level, n).flatten()  # [B*n] padding entries at level n, after every real one
    sizes = torch.bincount(flat, minlength=n + 1).tolist()  # entries per level: the forward's one host read
    by_level = flat.argsort(stable=True).split(sizes)  # flat indices, level by level
    levels = [entries for entries in by_level[:n] if entries.numel()]
    return TreeLinks(
        rows=torch.tensor(rows, device=device),
        write_conv=(slot - base + kernel - 1).clamp(max=last_conv),
        window=window.clamp(0, last_conv),  # (a padding entry's may point anywhere: it is never read)
        write_state=(slot - base + 1).clamp(max=last_state),
        parent_state=parent,
        levels=levels,
    )
