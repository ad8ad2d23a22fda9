"""The SAGE study behind docs/sage_study.md (on the tiny `ci` calibration, so it cannot rot)."""

from __future__ import annotations

import math

import pytest
import torch
from vlmspec_eval.analysis import lagged_autocorrelation
from vlmspec_eval.sage_study import (
    ENDS,
    Study,
    policies,
    previous_alpha_pairs,
    ranks,
    report,
    run_study,
    spearman,
)
from vlmspec_eval.tasks import load_inputs

from vlmspec import VLMSpecPipeline
from vlmspec.policies.base import truncate_paths


def test_statistics_on_known_series() -> None:
    alternating = [[1.0, -1.0] * 10]
    auto = lagged_autocorrelation(alternating, (0, 1, 2))
    assert auto[0] == pytest.approx(1.0) and auto[1] == pytest.approx(-1.0) and auto[2] == pytest.approx(1.0)
    # AR(1) with phi = 0.8: autocorrelation 0.8 ** k
    gen = torch.Generator().manual_seed(0)
    x, series = 0.0, []
    for e in torch.randn(20000, generator=gen).tolist():
        x = 0.8 * x + e
        series.append(x)
    auto = lagged_autocorrelation([series], (1, 2, 3))
    for k in (1, 2, 3):
        assert auto[k] == pytest.approx(0.8**k, abs=0.03)
    assert ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [2.5, 0.0, 2.5, 1.0]
    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_policies_share_the_budget() -> None:
    chosen = policies(32)
    assert len(chosen["static"].config.paths) == 32
    assert max(map(len, chosen["static"].config.paths)) == 3
    assert (chosen["sage"].config.n_max, chosen["sage"].config.d_max) == (32, 10)
    assert (chosen["eagle2"].config.total_tokens, chosen["eagle2"].config.depth) == (32, 6)
    paths = truncate_paths([(0,), (1, 0), (0, 0), (0, 0, 0)], 3)
    assert paths == ((0,), (0, 0), (0, 0, 0))  # (1, 0) has no parent in the tree


@pytest.fixture(scope="module")
def study() -> Study:
    torch.manual_seed(0)
    pipe = VLMSpecPipeline.from_pretrained("testbed-mini@ci")
    examples = load_inputs(["image_caption", "video_caption"], 1, seed=200)
    return run_study(pipe, examples, max_new_tokens=16, budget=32)


def test_study_records_every_step(study: Study) -> None:
    sage = study.outputs["sage"]
    assert all(out == sage for out in study.outputs.values())  # lossless: one text whatever the tree
    for name, steps in study.runs.items():
        assert {s.caption for s in steps} == {0, 1}
        for caption, tokens in enumerate(study.outputs[name]):
            mine = [s for s in steps if s.caption == caption]
            # every step emits its accepted tokens plus the bonus; the prefill gives the first token
            assert 1 + sum(s.accepted + 1 for s in mine) >= len(tokens)
        for s in steps:
            assert 0 <= s.accepted <= s.tree_depth <= s.tree_size <= 32
            assert s.end in ENDS
            assert (s.miss_rank is not None) == (s.end == "narrow")
            assert s.end != "max depth" or s.accepted == s.tree_depth
            assert 0.0 < s.root_top1 <= 1.0 and 0.0 <= s.root_alpha <= 1.0 and s.root_entropy >= 0.0
            if s.miss_rank is not None:
                assert s.miss_rank >= 0
    # SAGE's lookahead: the alpha it shaped a tree with is the previous step's root alpha
    sage_steps = study.runs["sage"]
    for before, now in zip(sage_steps, sage_steps[1:], strict=False):
        if before.caption == now.caption:
            assert now.trace["alpha"] == pytest.approx(before.root_alpha)
    prev, acc = previous_alpha_pairs(sage_steps)
    assert len(prev) == len(acc) == len(sage_steps) - 2


def test_entropies_and_report(study: Study) -> None:
    for series in study.entropies.values():
        assert [len(s) for s in series] == [len(t) for t in study.outputs["sage"]]
        assert all(v >= 0 and math.isfinite(v) for s in series for v in s)
    assert lagged_autocorrelation(study.entropies["target"], (0,))[0] == pytest.approx(1.0)
    text = report(study)
    assert "Outputs identical across policies: True" in text
    for policy in ("sage", "static", "eagle2"):
        assert f"| {policy} | " in text
    assert "| draft | " in text and "| target | " in text
    assert "| lag 8 |" in text and "| sage | root alpha | 1.00 |" in text
