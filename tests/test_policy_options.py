"""Policy options mean what the user set: checked where they are given, kept through the hardware fit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from vlmspec import InputTypeError, InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.costs import ForwardCosts
from vlmspec.policies import MC_SIM_7B_63, SAGEConfig, SAGEPaperConfig

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.filterwarnings("ignore::vlmspec.SlowSpeculationWarning")


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", gamma=2, torch_dtype=torch.float32
    )


# ---- rank paths stay within the vocabulary ----------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "option"), [("static", "paths"), ("sage", "initial_paths")])
def test_a_rank_beyond_the_vocabulary_is_refused_when_the_policy_is_attached(pipe, policy, option):
    vocab = pipe._draft_vocab.proposable
    bad = get_policy(policy, **{option: [[0], [0, vocab]]})  # no vocabulary known yet: accepted
    with pytest.raises(InvalidInputError, match=rf"{option} holds the path \[0, {vocab}\], whose rank {vocab} "
                       rf"is beyond this pair's vocabulary of {vocab} tokens: use ranks below {vocab}"):  # fmt: skip
        pipe.policy = bad
    pipe.policy = get_policy(policy, **{option: [[0], [0, vocab - 1]]})  # the last rank there is
    prompt = "Describe a red circle."
    out = pipe(None, prompt, max_new_tokens=4)
    assert out.token_ids == pipe.reference_generate(pipe.prepare_inputs(None, prompt), 4)


@pytest.mark.parametrize("rank", [2**20, 10**30])  # MAX_RANK, and one past a C long
def test_an_absurd_rank_is_refused_with_the_config(rank):
    with pytest.raises(InvalidInputError, match=rf"StaticConfig.paths=\[0, {rank}\] is invalid: ranks below"):
        get_policy("static", paths=[[0], [0, rank]])


# ---- the hardware fit leaves the user's options as set ----------------------------------------------------------
STEEP = ForwardCosts(  # a verification that costs twice a forward at 4 tokens: a small tree, a shallow depth
    sizes=(1, 2, 4, 8, 16), target_s=(1.0, 1.2, 1.6, 2.5, 4.0), draft_s=(0.05,) * 5, prefix_tokens=128, runs=3
)
FLAT = ForwardCosts(  # a verification that costs one forward up to 64 tokens: the largest tree
    sizes=(1, 2, 4, 8, 16, 32, 64), target_s=(1.0,) * 7, draft_s=(0.05,) * 7, prefix_tokens=128, runs=3
)


def test_the_fit_keeps_a_set_d_min_and_fits_d_max_around_it():
    free = get_policy("sage")
    free.fit(STEEP)
    assert free.config.d_max < 5 and free.config.d_min == free.config.d_max  # the default d_min follows
    mine = get_policy("sage", d_min=5)
    mine.fit(STEEP)
    assert (mine.config.d_min, mine.config.d_max, mine.config.n_max) == (5, 5, free.config.n_max)


def test_the_fit_keeps_set_initial_paths_and_fits_n_max_around_them():
    mine = get_policy("sage", initial_paths=MC_SIM_7B_63[:20])
    mine.fit(STEEP)
    assert mine.config.initial_paths == MC_SIM_7B_63[:20] and mine.config.n_max == 20
    paper = get_policy("sage_paper")  # the paper's first tree is a default here: cut to the machine's budget
    paper.fit(STEEP)
    assert len(paper.config.initial_paths) == paper.config.n_max == STEEP.node_budget()


@pytest.mark.parametrize("name", ["sage", "static", "sage_paper"])
def test_a_refit_starts_from_the_user_s_config_not_the_earlier_fit(pipe, name):
    fresh = get_policy(name)
    fresh.fit(FLAT)
    pipe.costs = STEEP
    pipe.policy = name
    assert pipe.policy.config.node_budget == STEEP.node_budget() < fresh.config.node_budget
    pipe.costs = FLAT
    pipe.policy = pipe.policy  # the documented refit: assign the costs, re-assign the policy
    assert pipe.policy.config == fresh.config  # what the steep fit cut is back
    pipe.costs = None  # the probe's again, for the other tests


# ---- policy YAML files ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            b"policy: sage\nn_max: 16\n  bad: [\n",
            r"is not valid YAML: mapping values are not allowed here \(line 3",
        ),
        ("policy: sage\n# caf\xe9\n".encode("latin-1"), "is not UTF-8 text .*: save it as UTF-8"),
        (b"- n_max\n- 16\n", "must hold a mapping of option: value lines"),
    ],
)
def test_a_policy_file_that_cannot_be_read_is_named(tmp_path, text, message):
    path = tmp_path / "mine.yaml"
    path.write_bytes(text)
    for load in (lambda: get_policy("sage", path), lambda: SAGEConfig.from_yaml(path)):
        with pytest.raises(InvalidInputError, match=rf"policy config '{path}' {message}"):
            load()


def test_a_policy_file_loads_only_as_the_policy_its_policy_key_names(tmp_path):
    paper = ROOT / "configs" / "policies" / "sage_paper.yaml"
    assert get_policy("sage_paper", paper).config == SAGEPaperConfig() == SAGEPaperConfig.from_yaml(paper)
    for load in (lambda: get_policy("sage", paper), lambda: SAGEConfig.from_yaml(paper)):
        with pytest.raises(InvalidInputError, match=r"configures policy 'sage_paper' \(its policy: key\), not "
                           r"'sage': load it as 'sage_paper' \(get_policy\('sage_paper', "):  # fmt: skip
            load()
    weird = tmp_path / "weird.yaml"
    weird.write_text("policy: [not, a, name]\nn_max: 16\n")
    with pytest.raises(InvalidInputError, match=r"policy: \['not', 'a', 'name'\] is not a policy name"):
        get_policy("sage", weird)
    weird.write_text("n_max: 16\n")  # no policy: key: the file is the options alone
    assert get_policy("sage", weird).config.n_max == SAGEConfig.from_yaml(weird).n_max == 16


# ---- every path from options to a config validates the same merged config ------------------------------------
def test_a_depth_below_the_default_d_min_means_the_same_on_every_path(tmp_path):
    from vlmspec_eval.lmms.options import parse_model_args

    mine = tmp_path / "mine.yaml"
    mine.write_text("policy: sage\nd_max: 4\n")
    expected = SAGEConfig(d_min=4, d_max=4)
    assert get_policy("sage", d_max=4).config == get_policy("sage", {"d_max": 4}).config == expected
    assert SAGEConfig.from_dict({"d_max": 4}) == SAGEConfig.from_yaml(mine) == get_policy("sage", mine).config
    model = parse_model_args({"target": "testbed-mini", "policy": "sage", "d_max": "4"})
    assert model.policy_options == {"d_max": 4}
    for load in (
        lambda: get_policy("sage", d_min=5, d_max=4),
        lambda: SAGEConfig.from_dict({"d_min": 5, "d_max": 4}),
    ):
        with pytest.raises(InvalidInputError, match=r"d_max=4 is invalid: an integer >= d_min \(5\)"):
            load()  # both set: the user's own conflict


@pytest.mark.parametrize(
    ("name", "options", "implied"),
    [
        ("sage", {"d_min": 12}, {"d_max": 12}),  # the default d_max rises to a d_min set above it
        ("sage", {"initial_paths": MC_SIM_7B_63}, {"n_max": 63}),  # the default n_max, to the paths set
        ("sage_paper", {"n_max": 16}, {"initial_paths": MC_SIM_7B_63[:16]}),  # the paper's first tree, cut
        ("eagle2", {"top_k": 40}, {"depth": 5}),  # the default depth, within the expansion bound of top_k 40
    ],
)
def test_a_set_option_moves_the_defaults_it_conflicts_with(name, options, implied):
    policy = get_policy(name, **options)
    assert {k: getattr(policy.config, k) for k in implied} == implied
    assert policy.requested == options and set(implied) <= set(policy.free_hardware_options()) | {
        "initial_paths"
    }


def test_a_mistyped_option_or_name_is_the_library_s_error_listing_the_valid_ones(tmp_path):
    with pytest.raises(
        InvalidInputError, match=r"SAGEConfig: unknown option\(s\) \['n_maxx'\]; valid options are"
    ):
        get_policy("sage", SAGEConfig(), n_maxx=3)  # overrides of a config object
    assert get_policy("sage", SAGEConfig(), n_max=3).config == SAGEConfig(n_max=3)
    with pytest.raises(
        InputTypeError, match=r"a policy name must be a string, got list \['sage'\]; available"
    ):
        get_policy(["sage"])
    keys = tmp_path / "keys.yaml"
    keys.write_text("policy: sage\n1: 2\nnull: 3\n")
    with pytest.raises(
        InvalidInputError, match=r"unknown option\(s\) \[1, None\]; valid options are \['confidence'"
    ):
        get_policy("sage", keys)


def test_an_error_in_a_saved_pipeline_s_policy_settings_names_its_file(tmp_path):
    settings = (
        tmp_path / "vlmspec_pipeline.yaml"
    )  # the policy is built before any model loads: no models needed
    settings.write_text("policy: sage\npolicy_options:\n  d_min: 5\n")
    with pytest.raises(InvalidInputError, match=rf"the policy options given \(d_max=4\) on top of the saved ones of "
                       rf"saved pipeline settings '{settings}' \(policy 'sage' with policy_options \{{'d_min': 5\}}\): "
                       r"SAGEConfig.d_max=4 is invalid"):  # fmt: skip
        VLMSpecPipeline.from_pretrained(tmp_path, d_max=4)
    settings.write_text("policy: sage\npolicy_options:\n  d_mn: 5\n")
    with pytest.raises(InvalidInputError, match=rf"saved pipeline settings '{settings}': policy 'sage' with "
                       r"policy_options \{'d_mn': 5\}: SAGEConfig: unknown option\(s\) \['d_mn'\]"):  # fmt: skip
        VLMSpecPipeline.from_pretrained(tmp_path)


# ---- numbers are finite -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value"), [("theta_scale", math.inf), ("lower", -math.inf), ("upper", math.nan)]
)
def test_a_non_finite_option_is_refused(option, value):
    with pytest.raises(
        InvalidInputError, match=rf"SAGEConfig.{option}={value!r} is invalid: a finite number"
    ):
        get_policy(
            "sage", **{option: value}
        )  # theta_scale=inf kept no candidate: SAGE silently decoded plainly


def test_the_budget_factor_is_a_finite_number_checked_where_it_is_set(pipe):
    for value in (math.nan, math.inf, 0.5):
        with pytest.raises(
            InvalidInputError, match=rf"pipe.budget_factor={value!r} is invalid: use a finite number"
        ):
            pipe.budget_factor = value
        with pytest.raises(InvalidInputError, match=rf"budget factor={value!r} is invalid"):
            FLAT.node_budget(value)
    with pytest.raises(
        InputTypeError, match=r"pipe.budget_factor='2' is invalid: expected a number, got str"
    ):
        pipe.budget_factor = "2"
    assert pipe.budget_factor == 2.0  # as it was
    pipe.budget_factor = 3
    assert pipe.budget_factor == 3.0 and FLAT.node_budget(3) == FLAT.node_budget(3.0)
    pipe.budget_factor = 2.0


def test_a_file_option_takes_a_pathlib_path_as_its_text():
    import vlmspec

    weights = Path(vlmspec.__file__).parent / "assets" / "c2t_default.safetensors"
    policy = get_policy("c2t", classifier=weights)
    assert policy.config.classifier == str(weights) and policy.requested == {"classifier": str(weights)}
    assert policy.config == get_policy("c2t", classifier=str(weights)).config


# ---- messages that name the right thing -------------------------------------------------------------------------
def test_messages_blame_what_to_change_and_warnings_point_at_the_user_s_line(pipe):
    with pytest.raises(
        InvalidInputError, match=r"EAGLE2Config.depth=1000000 is invalid: at most 8192 // top_k\^2"
    ):
        get_policy("eagle2", depth=10**6)  # no top_k fits: the depth is at fault, not the default top_k
    with pytest.raises(InputTypeError, match=r"policy=SAGEConfig\(...\) is a policy's config, not a policy: pass "
                       r"policy=get_policy\('sage', config\)"):  # fmt: skip
        VLMSpecPipeline(pipe.target, pipe.draft, pipe.processor, policy=SAGEConfig(n_max=8))
    with pytest.warns(UserWarning, match="wetap_beam") as caught:
        get_policy("wetap", acceptance="wetap_beam")
    assert caught[0].filename == __file__


def test_an_empty_policy_file_is_refused_not_read_as_the_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here yet\n")
    for load in (lambda: get_policy("chain", empty), lambda: SAGEConfig.from_yaml(empty)):
        with pytest.raises(InvalidInputError, match=rf"policy config '{empty}' is empty: write its options"):
            load()
    empty.write_text("policy: chain\n")  # the defaults, asked for by name
    assert get_policy("chain", empty).config == get_policy("chain").config
