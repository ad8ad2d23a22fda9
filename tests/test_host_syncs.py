"""Host syncs per decoding step stay what the algorithms need (``vlmspec.host_syncs``), so they cannot creep back.

What a step needs: one read of what the target accepted (the path's length depends on the target's choices; with
it come the tokens to emit and where the path sits in the draft cache), all a plain ``ar`` step makes too.
On top of that, per policy: the paper's SAGE reads this step's alpha (1 per step) and PCT its kept leaves (1 per
step); SAGE, PCT and C2T keep a value-dependent set of candidates per level (1 per draft forward; ``sage``'s cost
growth decides on the host from that one read whether another level pays, and reads no alpha). Static, chain and
EAGLE-2
grow their trees with no host sync at all. Near ``max_new_tokens`` the draft drops children past the depth limit
(a host sync per level in the last steps only: :data:`END_OF_GENERATION`).
"""

from __future__ import annotations

import pytest
import torch
from synthetic import peaked, synthetic_tree

from vlmspec import VLMSpecPipeline
from vlmspec.costs import ForwardCosts
from vlmspec.host_syncs import HostSyncCounter
from vlmspec.testing import FAMILIES, make_image

STEP = 1  # what the target accepted: path, emitted tokens, the path's draft-cache slots
PER_STEP = {
    "ar": STEP,
    "chain": STEP,
    "static": STEP,
    "eagle2": STEP,
    "sage": STEP,
    "sage_paper": STEP + 1,
    "pct": STEP + 1,
    "c2t": STEP,
}
PER_DRAFT_FORWARD = {"sage": 1, "sage_paper": 1, "pct": 1, "c2t": 1}
END_OF_GENERATION = 12
CPU_LIKE = ForwardCosts(
    sizes=(1, 2, 4, 8, 16, 32, 64),
    target_s=(1.0, 1.1, 1.3, 1.8, 2.5, 4.0, 7.0),
    draft_s=(0.04,) * 7,
    prefix_tokens=8,
    runs=1,
)  # fixed costs, so the trees (and the counts) do not depend on this machine's timings


@pytest.mark.parametrize("family", FAMILIES)
def test_host_syncs_per_step_are_bounded(tiny_pairs, family):
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    pipe.costs = CPU_LIKE
    forwards = []
    pipe.draft.register_forward_hook(lambda *_: forwards.append(1))
    image = make_image(0)
    for name, per_step in PER_STEP.items():
        pipe.policy = name
        with HostSyncCounter() as prefill:  # the prefills and the first token: no decoding step
            pipe(image, "Describe.", max_new_tokens=1)
        prefill_forwards = len(forwards)
        with HostSyncCounter() as run:
            out = pipe(image, "Describe.", max_new_tokens=40)
        draft_forwards = len(forwards) - 2 * prefill_forwards
        forwards.clear()
        decode = run.total - prefill.total
        bound = (
            per_step * out.stats.steps + PER_DRAFT_FORWARD.get(name, 0) * draft_forwards + END_OF_GENERATION
        )
        assert out.stats.steps > 0 and decode <= bound, f"{family}/{name}: {decode} > {bound} ({run.counts})"
    assert decode >= out.stats.steps * STEP  # the counter sees the syncs the step needs


@pytest.mark.parametrize("policy", ["chain", "static", "sage"])
def test_an_edd_draft_adds_no_host_sync(tiny_pairs, policy):
    """With an EDD draft the step keeps the same budget: the hidden states of the accepted path are gathered on
    the device."""
    from vlmspec.models import EDDDraft

    pair = tiny_pairs["qwen2_vl"]
    base = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    pipe = VLMSpecPipeline(base.target, EDDDraft.for_target(base.target), base.processor, policy="ar")
    pipe.costs = CPU_LIKE
    pipe.policy = policy
    image = make_image(0)
    with HostSyncCounter() as prefill:
        pipe(image, "Describe.", max_new_tokens=1)
    with HostSyncCounter() as run:
        out = pipe(image, "Describe.", max_new_tokens=40)
    levels = sum(step.get("depth", 0) for step in out.stats.trace) if policy == "sage" else 0
    bound = PER_STEP[policy] * out.stats.steps + PER_DRAFT_FORWARD.get(policy, 0) * levels
    assert out.stats.steps > 0 and run.total - prefill.total <= bound + END_OF_GENERATION, run.counts


def test_counter_sees_reads_and_value_dependent_shapes():
    x = torch.arange(6)
    with HostSyncCounter() as syncs:
        x.tolist(), int(x[0]), bool(x[1] > 0), x.nonzero(), x[x > 2]
        x + 1, x[1:3], x.topk(2)  # none of these sync
    assert syncs.counts == {"tolist": 1, "__int__": 1, "__bool__": 1, "nonzero": 1, "__getitem__[mask]": 1}


def test_draft_tree_rules_hold_without_host_syncs():
    draft, _ = synthetic_tree(peaked(16, 0.9))
    with pytest.raises(RuntimeError, match="root on its own"):
        draft.next_probs(torch.tensor([0, 1]))
    draft, _ = synthetic_tree(peaked(16, 0.9))
    with pytest.raises(RuntimeError, match="expand the root before"):
        draft.next_probs(torch.tensor([3]))
    draft, _ = synthetic_tree(peaked(16, 0.9))
    probs = draft.next_probs(torch.zeros(1, dtype=torch.long))
    ids = draft.add(torch.zeros(2, dtype=torch.long), probs[0].topk(2).indices, probs[0].topk(2).values)
    draft.next_probs(ids[:1])
    with pytest.raises(RuntimeError, match="only once"):
        draft.next_probs(ids[:1])
    child = draft.add(ids[:1], torch.tensor([5]), torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="every ancestor"):
        draft.tree(torch.tensor([0, int(child)]))


@pytest.mark.parametrize("name", ["ar", "chain"])
def test_generate_s_logits_processors_add_no_host_sync(tiny_pairs, name):
    """The repetition penalty and the minimum length work on device tensors: a step keeps its budget."""
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy=name, torch_dtype=torch.float32)
    pipe.costs = CPU_LIKE
    options = {"repetition_penalty": 1.2, "min_new_tokens": 5}
    image = make_image(0)
    with HostSyncCounter() as prefill:
        pipe(image, "Describe.", max_new_tokens=1, **options)
    with HostSyncCounter() as run:
        out = pipe(image, "Describe.", max_new_tokens=40, **options)
    decode = run.total - prefill.total
    assert out.stats.steps > 0 and decode <= PER_STEP[name] * out.stats.steps + END_OF_GENERATION, run.counts
