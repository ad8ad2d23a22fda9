"""Named pairs (``testbed-base``, ``testbed-mini``, ``tiny``) and the default pair of ``from_pretrained()``."""

from __future__ import annotations

import pytest

from vlmspec import named_pairs, testbed
from vlmspec.testing import build_tiny_pair


@pytest.fixture
def fake_testbed(monkeypatch, tmp_path):
    calls = []

    def pair_paths(size, family):
        calls.append((size, family))
        return tmp_path / f"{family}-{size}" / "target", tmp_path / f"{family}-{size}" / "draft"

    monkeypatch.setattr(testbed, "pair_paths", pair_paths)
    monkeypatch.delenv(named_pairs.ENV_DEFAULT_PAIR, raising=False)
    return calls, tmp_path


def test_no_target_means_the_calibrated_testbed_base_pair(fake_testbed):
    calls, root = fake_testbed
    pair = named_pairs.resolve_pair(None)
    assert calls == [("base", "qwen2_vl")]
    assert pair == named_pairs.ResolvedPair(
        str(root / "qwen2_vl-base" / "target"),
        str(root / "qwen2_vl-base" / "draft"),
        "testbed:base:qwen2_vl@cpu",
        "cpu",
    )


def test_pair_names_with_family_and_env_default(fake_testbed, monkeypatch):
    calls, _ = fake_testbed
    assert named_pairs.resolve_pair("testbed-mini:llava_onevision").source == "testbed:mini:llava_onevision"
    # One resolver for every entry point: a family for names that give none, never over one that does.
    assert (
        named_pairs.resolve_pair("testbed-mini", family="llava_onevision").source
        == "testbed:mini:llava_onevision"
    )
    assert named_pairs.resolve_pair("testbed-mini:qwen2_vl@cpu", family="llava_onevision").source == (
        "testbed:mini:qwen2_vl@cpu"
    )
    monkeypatch.setenv(named_pairs.ENV_DEFAULT_PAIR, "testbed-mini")
    assert named_pairs.resolve_pair(None).source == "testbed:mini:qwen2_vl"
    assert named_pairs.resolve_pair("testbed-base", draft="my/draft").draft == "my/draft"
    assert calls == [("mini", "llava_onevision")] * 2 + [("mini", "qwen2_vl")] * 2 + [("base", "qwen2_vl")]
    monkeypatch.setenv(named_pairs.ENV_DEFAULT_PAIR, "Qwen/Qwen2-VL-7B")
    with pytest.raises(ValueError, match="VLMSPEC_DEFAULT_PAIR='Qwen/Qwen2-VL-7B' is not a pair name"):
        named_pairs.resolve_pair(None)


def test_other_targets_pass_through_and_folders_win(tmp_path, fake_testbed):
    assert named_pairs.resolve_pair("Qwen/Qwen2-VL-7B", "Qwen/Qwen2-VL-2B") == named_pairs.ResolvedPair(
        "Qwen/Qwen2-VL-7B", "Qwen/Qwen2-VL-2B", "explicit"
    )
    folder = tmp_path / "tiny"
    folder.mkdir()
    assert named_pairs.resolve_pair(folder).source == "explicit"  # an existing folder named like a pair
    assert not named_pairs.is_pair_name(folder) and named_pairs.is_pair_name("tiny:qwen3_vl")


def test_unknown_family_is_named(fake_testbed):
    with pytest.raises(ValueError, match=f"no 'qwen3_vl_moe' pair; valid: {', '.join(testbed.FAMILIES)}$"):
        named_pairs.resolve_pair("testbed-base:qwen3_vl_moe")
    with pytest.raises(ValueError, match="unknown family 'qwen9'"):
        named_pairs.resolve_pair("tiny:qwen9")


def test_from_pretrained_resolves_a_named_pair(tiny_root, monkeypatch):
    from vlmspec import VLMSpecPipeline

    built = build_tiny_pair("llava_onevision", root=tiny_root)
    monkeypatch.setattr(named_pairs, "build_tiny_pair", lambda family: built, raising=False)
    monkeypatch.setattr("vlmspec.testing.build_tiny_pair", lambda family: built)
    pipe = VLMSpecPipeline.from_pretrained("tiny:llava_onevision", policy="chain")
    assert type(pipe.target).__name__ == "LlavaOnevisionForConditionalGeneration"
    assert pipe.draft is not None and pipe.policy.name == "chain"


def test_the_demo_and_the_bench_honour_the_default_pair_variable(monkeypatch, capsys):
    from vlmspec_eval.tasks import resolve_pair as bench_pair

    from vlmspec.cli import main as cli_main

    monkeypatch.setenv("VLMSPEC_DEFAULT_PAIR", "testbed-mini")
    assert bench_pair(None, None, "qwen2_vl").source == "testbed:mini:qwen2_vl"
    assert bench_pair(None, None, "qwen2_vl", size="base").source.startswith("testbed:base:")  # --size wins
    monkeypatch.setenv("VLMSPEC_DEFAULT_PAIR", "bogus")
    assert cli_main(["demo", "--max-new-tokens", "2", "--no-compare"]) == 1
    assert "VLMSPEC_DEFAULT_PAIR='bogus' is not a pair name" in capsys.readouterr().err
    assert cli_main(["demo", "--pair", "nope"]) == 1
    assert "vlmspec demo: error: --pair 'nope' is not a pair name" in capsys.readouterr().err


def test_a_command_whose_policy_drafts_nothing_loads_no_draft(capsys):
    """``vlmspec demo`` and ``vlmspec serve`` keep the policy they start with: under ``--policy ar`` the pair's draft
    is never run, so it is not loaded; a policy that drafts loads it."""
    from vlmspec.cli import build_parser, load_pipeline
    from vlmspec.cli import main as cli_main

    def loaded(policy: str):
        return load_pipeline(
            build_parser().parse_args(["demo", "--pair", "testbed-mini", "--policy", policy]), "x"
        )

    assert loaded("ar").draft is None
    assert loaded("chain").draft is not None
    assert cli_main(["demo", "--pair", "testbed-mini", "--policy", "ar", "--max-new-tokens", "8"]) == 0
    assert "output vs generate(): identical" in capsys.readouterr().out
