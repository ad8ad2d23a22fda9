"""A Gated DeltaNet layer (Qwen3.5's recurrent layers) over a tree of tokens, one forward for the whole tree.

transformers' layer runs its tokens as one sequence (a chunked scan for a prompt, one step for a decoded token).
Here every new entry advances its own parent's state by one step, with transformers' own one-step function (the
one ``generate()`` decodes with), a level of the tree at a time (each level's entries in one batched call); its
convolution reads its ancestors' inputs (:mod:`vlmspec.recurrent_cache` says how the mask gives them). The maths is
the layer's own, step for step: projections, the causal convolution and its activation, the L2-normed queries and
keys, the decay ``g = -exp(A_log) * softplus(a + dt_bias)``, the gate ``beta = sigmoid(b)``, the gated RMS norm and
the output projection, all through the layer's modules and its modeling module's functions.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .hybrid import LayerCall


def gated_delta_tree(layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """The output ``[B, n, D]`` of ``layer`` (a ``...GatedDeltaNet``) for ``hidden`` ``[B, n, D]`` (the normed input
    of ``n`` new entries per row), whose states and convolution inputs are written to ``call.recurrent`` as pending
    entries."""
    recurrent, links, index = call.recurrent, call.links, call.index
    rows, n = hidden.shape[:2]
    state = recurrent.state[recurrent.index[index]]  # [max_rows, 1+P, H, Dk, Dv]

    # 1. The convolution over each entry's window: its ancestors' inputs, then its own.
    mixed = recurrent.convolved(links, index, layer.in_proj_qkv(hidden), layer.conv1d)  # [B*n, C]
    mixed = ACT2FN[layer.activation](mixed).to(hidden.dtype)
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(rows * n, 1, -1, layer.head_k_dim)
    key = key.reshape(rows * n, 1, -1, layer.head_k_dim)
    value = value.reshape(rows * n, 1, -1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden).sigmoid().view(rows * n, 1, -1)
    decay = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden).float() + layer.dt_bias)
    decay = decay.view(rows * n, 1, -1)

    # 2. The recurrence, a level at a time: each entry's state is its parent's advanced by its one token.
    step = sys.modules[type(layer).__module__].torch_recurrent_gated_delta_rule
    states = state.view(-1, *state.shape[2:])  # [max_rows * (1+P), H, Dk, Dv]
    stride = state.shape[1]
    write = (links.rows[:, None] * stride + links.write_state).flatten()  # [B*n]
    parent = (links.rows[:, None] * stride + links.parent_state).flatten()
    core = value.new_zeros(rows * n, layer.num_v_heads, layer.head_v_dim)
    for entries in links.levels:
        out, last = step(
            query[entries],
            key[entries],
            value[entries],
            g=decay[entries],
            beta=beta[entries],
            initial_state=states[parent[entries]],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        core[entries] = out[:, 0]
        states[write[entries]] = last.to(states.dtype)

    # 3. The gated norm and the output projection.
    gate = layer.in_proj_z(hidden).reshape(-1, layer.head_v_dim)
    out = layer.norm(core.reshape(-1, layer.head_v_dim), gate).reshape(rows, n, -1)
    return layer.out_proj(out)
