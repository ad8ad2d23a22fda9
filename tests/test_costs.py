"""Hardware-aware budgets: the cost maths (``vlmspec.costs``), the probe and its cache (``vlmspec.probe``), the one
node-budget notion of every policy config and the pipeline fitting the options a user leaves out."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from vlmspec import SlowSpeculationWarning, VLMSpecPipeline, get_policy
from vlmspec import probe as probe_module
from vlmspec.costs import BATCH_RATE_SHARE, BATCH_SIZES, MAX_NODE_BUDGET, ForwardCosts, monotone_envelope
from vlmspec.policies import MC_SIM_7B_63, SAGEConfig, SAGEPolicy, available_policies, policy_class
from vlmspec.policies.base import truncate_paths
from vlmspec.probe import cached_costs, probe_costs
from vlmspec.testing import build_tiny_pair

SIZES = (1, 2, 4, 8, 16, 32, 64)


def costs(target, draft=None):
    return ForwardCosts(
        sizes=SIZES, target_s=tuple(target), draft_s=tuple(draft) if draft else None, prefix_tokens=10, runs=1
    )


CPU = costs(
    [1.0, 1.1, 1.3, 1.8, 2.5, 4.0, 7.0], draft=[0.04] * 7
)  # a CPU-like curve, draft 1/25 of the target
GPU = costs([1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.5], draft=[0.4] * 7)  # flat to 64 tokens, a launch-bound draft


# ---- the maths --------------------------------------------------------------------------------------------------
def test_node_budget_follows_the_cost_curve():
    assert GPU.node_budget() == min(63, MAX_NODE_BUDGET)
    assert CPU.node_budget() == 7 and CPU.node_budget(factor=3.0) == 15
    spiky = costs([5.0, 1.0, 9.0, 1.1, 1.2, 3.0, 4.0])  # noise spikes are ignored (non-decreasing envelope)
    assert monotone_envelope(spiky.target_s) == [1.0, 1.0, 1.1, 1.1, 1.2, 3.0, 4.0]
    assert spiky.node_budget() == 15
    assert costs([1.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]).node_budget() == 1  # at least one node
    with pytest.raises(ValueError, match="factor=0.5"):
        CPU.node_budget(0.5)


def test_a_batch_shares_the_budget_of_its_verification():
    """``rows`` requests verified together: each gets the budget whose batched verification stays within ``factor``
    batched AR steps, so trees shrink as the batch grows on a compute-bound curve, and not on a flat one."""
    budgets = [CPU.node_budget(rows=rows) for rows in (1, 2, 4, 8)]
    assert (
        budgets[0] == CPU.node_budget()
        and budgets == sorted(budgets, reverse=True)
        and budgets[-1] < budgets[0]
    )
    for rows, nodes in zip((2, 4, 8), budgets[1:], strict=True):
        assert CPU.target_cost(rows * (nodes + 1)) <= 2 * CPU.target_cost(rows)
        assert nodes == MAX_NODE_BUDGET or CPU.target_cost(rows * (nodes + 2)) > 2 * CPU.target_cost(rows)
    assert GPU.node_budget(rows=2) > CPU.node_budget(rows=2)
    with pytest.raises(ValueError, match="rows=0"):
        CPU.node_budget(rows=0)


def test_default_batch_size_follows_the_expected_throughput():
    flat = costs([1.0] * 7, draft=[0.05] * 7)  # a batch costs what one request costs: the largest batch wins
    assert flat.batch_size() == 32 and flat.batch_size(speculative=False) == 32
    linear = costs([float(n) for n in SIZES], draft=[0.05 * n for n in SIZES])  # compute bound from one token
    assert linear.batch_size(speculative=False) == 1  # batching plain decoding buys nothing there
    # A CPU-like curve: the choice is the smallest batch within BATCH_RATE_SHARE of the best expected rate.
    rates = {}
    for rows in BATCH_SIZES:
        nodes = CPU.node_budget(rows=rows)
        rates[rows] = CPU.step_rate(nodes, CPU.depth_budget(nodes, rows=rows), rows=rows)
    chosen = CPU.batch_size()
    assert rates[chosen] >= BATCH_RATE_SHARE * max(rates.values())
    assert all(rates[rows] < BATCH_RATE_SHARE * max(rates.values()) for rows in BATCH_SIZES if rows < chosen)


def test_depth_budget_is_deep_for_a_cheap_draft_and_shallow_for_a_dear_one():
    cheap, dear = CPU.depth_budget(15), costs(CPU.target_s, draft=[0.5] * 7).depth_budget(15)
    assert cheap >= 8 and dear <= 4 and 1 <= dear < cheap <= 15
    assert GPU.depth_budget(63) < CPU.depth_budget(63)  # the GPU-like draft costs 0.4 of its target
    assert CPU.depth_budget(1) == 1
    with pytest.raises(ValueError, match="acceptance=1"):
        CPU.depth_budget(8, acceptance=1)


def test_expected_speedup_says_when_a_draft_costs_too_much_to_pay():
    launch_bound = costs([1.0] * 7, draft=[0.95] * 7)  # a separate draft on a GPU in eager mode (docs/gpu.md)
    assert CPU.expected_speedup(15, 10) > 1.5 and launch_bound.expected_speedup(63, 1) < 1
    assert CPU.expected_speedup(15, 10) == CPU.step_rate(15, 10) / CPU.step_rate(0, 0)
    for name in available_policies():
        policy = get_policy(name)
        if not policy.uses_draft:
            continue
        for machine, slow in ((CPU, False), (GPU, False), (launch_bound, True)):
            policy.fit(machine)
            assert (policy.expected_speedup(machine) < 1) == slow, (name, machine.draft_s[0])


def test_costs_validate_and_round_trip():
    assert ForwardCosts.from_dict(json.loads(json.dumps(CPU.to_dict()))) == CPU
    assert CPU.cost_ratio == pytest.approx(0.04) and CPU.target_cost(3) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="sizes"):
        ForwardCosts(sizes=(2, 4), target_s=(1.0, 1.0), draft_s=None, prefix_tokens=1, runs=1)
    with pytest.raises(ValueError, match="target_s"):
        ForwardCosts(sizes=(1, 2), target_s=(1.0,), draft_s=None, prefix_tokens=1, runs=1)


# ---- one node budget in every policy config -----------------------------------------------------------------
def test_truncate_paths_keeps_prefix_closed_trees():
    paths = ((0,), (0, 0), (1,), (0, 0, 0), (2, 0), (2,), (0, 1))
    assert truncate_paths(paths, 5) == ((0,), (0, 0), (1,), (0, 0, 0), (2,))  # (2, 0) came before its prefix
    assert truncate_paths(paths, 100) == ((0,), (0, 0), (1,), (0, 0, 0), (2,), (0, 1))


def test_every_tree_policy_takes_a_budget_through_its_config():
    for name in available_policies():
        config = policy_class(name).config_class()
        if config.budget_field is not None:
            smaller = config.with_budget(nodes=5)
            assert smaller.node_budget == 5, name
        if config.depth_field is not None:
            assert getattr(config.with_budget(depth=3), config.depth_field) == 3, name
    assert policy_class("static").config_class().with_budget(nodes=10).paths == MC_SIM_7B_63[:10]
    sage = SAGEConfig(d_min=4, initial_paths=MC_SIM_7B_63[:20], n_max=32).with_budget(nodes=8, depth=3)
    assert (sage.n_max, sage.d_max, sage.d_min, len(sage.initial_paths)) == (8, 3, 3, 8)  # kept consistent
    with pytest.raises(ValueError, match="nodes=0"):
        SAGEConfig().with_budget(nodes=0)


def test_fit_sets_only_what_the_user_left_out():
    free = get_policy("sage", growth="paper")
    free.fit(CPU)
    assert (free.config.n_max, free.config.d_max) == (7, CPU.depth_budget(7))
    mine = get_policy("sage", growth="paper", n_max=20)
    mine.fit(CPU)
    assert mine.config.n_max == 20 and mine.config.d_max == CPU.depth_budget(20)
    by_cost = get_policy(
        "sage", n_max=20
    )  # growth="cost": its level rule decides the depth, the budget bounds it
    by_cost.fit(CPU)
    assert (by_cost.config.n_max, by_cost.config.d_max) == (20, 20)
    assert by_cost.expected_speedup(CPU) == pytest.approx(mine.expected_speedup(CPU))
    given = SAGEPolicy(SAGEConfig(n_max=20))  # a config object is used as given
    given.fit(CPU)
    assert given.config == SAGEConfig(n_max=20) and given.free_hardware_options() == ()
    paper = get_policy("sage_paper")
    paper.fit(CPU)
    assert paper.config.n_max == 7 and paper.config.d_max == 8  # the paper's depth range stays literal
    chain = get_policy("chain")
    chain.fit(CPU)
    assert chain.config.gamma == CPU.depth_budget(CPU.node_budget())
    ar = get_policy("ar")
    assert ar.free_hardware_options() == ()


# ---- the probe and the pipeline --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_pipe(tiny_root):
    pair = build_tiny_pair("qwen2_vl", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)


def test_probe_measures_both_models_and_the_cache_reuses_it(qwen_pipe, tmp_path):
    measured = probe_costs(qwen_pipe.target, qwen_pipe.draft, sizes=(4, 1, 8), runs=2, context=8)
    assert measured.sizes == (1, 4, 8) and measured.prefix_tokens == 8
    assert all(t > 0 for t in measured.target_s + measured.draft_s)
    first = cached_costs(qwen_pipe.target, qwen_pipe.draft, folder=tmp_path, sizes=(1, 2), runs=1, context=8)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["sizes"] == [1, 2]
    again = cached_costs(qwen_pipe.target, qwen_pipe.draft, folder=tmp_path, sizes=(1, 2), runs=1, context=8)
    assert again == first  # read back, not measured again (timings never repeat exactly)
    cached_costs(qwen_pipe.target, None, folder=tmp_path, sizes=(1, 2), runs=1, context=8)
    assert len(list(tmp_path.glob("*.json"))) == 2  # another model set is another entry
    files[0].write_text("{not json")
    remeasured = cached_costs(
        qwen_pipe.target, qwen_pipe.draft, folder=tmp_path, sizes=(1, 2), runs=1, context=8
    )
    assert remeasured.sizes == (1, 2) and json.loads(files[0].read_text())["sizes"] == [
        1,
        2,
    ]  # measured, rewritten


def scripted_timings(monkeypatch, pipe, slow_rounds, sizes):
    """The probe's forwards take scripted seconds: the target ``n * 1e-3 + 0.01``, the draft a fifth of that, with
    a small jitter per round, 4x slower in the rounds ``slow_rounds(round)`` says the machine was busy."""
    calls = []

    def forward(prefixed, n):
        round_ = len(calls) // (2 * len(sizes))
        calls.append(n)
        seconds = (n * 1e-3 + 0.01) * (1.0 if prefixed.adapter.model is pipe.target else 0.2)
        return seconds * (1.0 + 0.01 * (round_ % 3)) * (4.0 if slow_rounds(round_) else 1.0)

    monkeypatch.setattr(probe_module._Prefixed, "__call__", forward)
    return calls


def test_probe_leaves_out_the_rounds_a_busy_machine_slowed(qwen_pipe, monkeypatch):
    # Busy through the first two rounds: a median of the first three would be the busy machine's (4x); the probe
    # times two more rounds and takes the median of the three undisturbed ones.
    sizes = (1, 2, 4)
    calls = scripted_timings(monkeypatch, qwen_pipe, lambda round_: round_ < 2, sizes)
    measured = probe_costs(qwen_pipe.target, qwen_pipe.draft, sizes=sizes, runs=3, context=8, warmup=0)
    assert len(calls) == 5 * 2 * len(sizes)  # 5 rounds of both models at every size
    calm = [(n * 1e-3 + 0.01) * 1.01 for n in sizes]  # the rounds 2, 3, 4: jitter 1.02, 1.0, 1.01
    assert measured.target_s == pytest.approx(calm) and measured.draft_s == pytest.approx(
        [t * 0.2 for t in calm]
    )
    assert measured.settled and measured.runs == 3
    # A quiet machine: the three rounds asked for, nothing more.
    calls = scripted_timings(monkeypatch, qwen_pipe, lambda round_: False, sizes)
    assert probe_costs(qwen_pipe.target, qwen_pipe.draft, sizes=sizes, runs=3, context=8, warmup=0).settled
    assert len(calls) == 3 * 2 * len(sizes)


def test_a_probe_on_a_machine_that_stays_busy_is_used_but_not_cached(qwen_pipe, monkeypatch, tmp_path):
    monkeypatch.setattr(probe_module, "_BUSY_READINGS", {})  # this process's busy readings, none yet
    sizes = (1, 2)
    args = dict(folder=tmp_path, sizes=sizes, runs=2, context=8)
    # Quiet through the warmup (round 0) and the first timed round, busy from then on.
    calls = scripted_timings(monkeypatch, qwen_pipe, lambda round_: round_ > 1, sizes)
    with pytest.warns(
        UserWarning, match=r"the machine was busy .* \(1 of the 2 rounds wanted ran undisturbed\)"
    ):
        busy = cached_costs(qwen_pipe.target, qwen_pipe.draft, **args)
    assert len(calls) == (1 + 3 * 2) * 2 * len(sizes)  # the warmup, then up to 3x the rounds asked for
    assert not busy.settled and busy.runs == 1 and list(tmp_path.glob("*.json")) == []
    assert busy.target_s == pytest.approx([(n * 1e-3 + 0.01) * 1.01 for n in sizes])  # the quiet round's
    # The next pipeline of this process reuses the reading without probing the busy machine again.
    calls = scripted_timings(monkeypatch, qwen_pipe, lambda round_: False, sizes)
    assert cached_costs(qwen_pipe.target, qwen_pipe.draft, **args) is busy and calls == []
    # The next process measures again; on a quiet machine its reading is cached.
    monkeypatch.setattr(probe_module, "_BUSY_READINGS", {})
    quiet = cached_costs(qwen_pipe.target, qwen_pipe.draft, **args)
    assert quiet.settled and quiet.runs == 2 and len(list(tmp_path.glob("*.json"))) == 1


def test_pipeline_fits_the_policy_to_its_costs(qwen_pipe):
    qwen_pipe.costs = CPU
    qwen_pipe.policy = "eagle2"
    assert qwen_pipe.policy.config.total_tokens == 7 and qwen_pipe.policy.config.depth == CPU.depth_budget(7)
    qwen_pipe.budget_factor = 3.0
    qwen_pipe.policy = get_policy("static")
    assert qwen_pipe.policy.config.node_budget == 15
    qwen_pipe.policy = get_policy("eagle2", total_tokens=40, depth=2)
    assert (qwen_pipe.policy.config.total_tokens, qwen_pipe.policy.config.depth) == (40, 2)
    qwen_pipe.policy, qwen_pipe.costs, qwen_pipe.budget_factor = "ar", None, 2.0


def test_pipeline_warns_when_its_policy_is_expected_to_lose(qwen_pipe):
    qwen_pipe.costs = costs([1.0] * 7, draft=[0.95] * 7)
    with pytest.warns(
        SlowSpeculationWarning, match=r"policy 'sage' is expected to run at 0\.\d\dx plain decoding"
    ) as caught:
        qwen_pipe.policy = "sage"
    assert caught[0].filename == __file__  # it points at the user's line, not the library's
    qwen_pipe.costs = CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowSpeculationWarning)
        qwen_pipe.policy = "sage"
        qwen_pipe.policy = "ar"  # no draft, nothing to expect


def test_tree_costs_price_a_node_and_a_level_in_plain_decoding_steps():
    node, level = CPU.tree_costs(7)  # c_t(8) = 1.8: seven nodes add 0.8 of a one-token forward
    assert node == pytest.approx(0.8 / 7) and level == pytest.approx(0.04)
    flat_node, launch_bound_level = GPU.tree_costs(63)  # c_t(64) = 1.5
    assert (
        flat_node == pytest.approx(0.5 / 63) and flat_node < node and launch_bound_level == pytest.approx(0.4)
    )
    # A batch of 4: a node is priced on one request's curve (the batch pads every tree to its largest), a level
    # as one batched draft forward against one batched plain step, c_t(4) = 1.3.
    batch_node, batch_level = CPU.tree_costs(3, rows=4)  # c_t(4) = 1.3 for three nodes of one request
    assert batch_node == pytest.approx(0.3 / 3) and batch_level == pytest.approx(0.04 / 1.3)
    sage = get_policy("sage")
    sage.fit(CPU, rows=4)
    assert sage.config.node_cost == pytest.approx(CPU.tree_costs(sage.config.n_max, rows=4)[0])
    with pytest.raises(ValueError, match="nodes=0"):
        CPU.tree_costs(0)


def test_pct_s_cost_ratio_is_fitted_at_the_batch_s_rows():
    """Batched, one forward of each model serves every row: PCT's s_d / s_t is the ratio at that many tokens."""
    costs = ForwardCosts(sizes=(1, 4), target_s=(0.04, 0.05), draft_s=(0.002, 0.01), prefix_tokens=8, runs=1)
    policy = get_policy("pct")
    policy.fit(costs, rows=4)
    assert policy.cost_ratio == pytest.approx(0.2)
    policy.fit(costs)
    assert policy.cost_ratio == pytest.approx(0.05)
