"""``vlmspec bench --sampling --dsbd`` (``vlmspec_eval.sampling``) on the trained testbed ``mini`` pair."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace

import pytest
import torch
from vlmspec_eval import bench
from vlmspec_eval.methods import build_variants
from vlmspec_eval.report import dsbd_markdown, sampling_markdown
from vlmspec_eval.sampling import (
    BEAM_SAMPLING,
    DSBD,
    DSBD_METHODS,
    MULTINOMIAL,
    SampleRun,
    auto_beam_width,
    dsbd_policy,
    dsbd_warping,
    measure_dsbd,
    run_beam,
    run_dsbd,
    run_sampled,
    sampling_variants,
    score_runs,
)
from vlmspec_eval.tasks import load_inputs

from vlmspec import VLMSpecPipeline
from vlmspec import testbed as vlmspec_testbed

MAX_NEW = 16
SAMPLING_METHODS = ("ar", "sage", "chain")
FAST = ["--n", "1", "--repeats", "2", "--max-new-tokens", str(MAX_NEW), "--probe-sizes", "1,2,4", "--probe-runs", "1",
        "--prune-ratios", "none", "--threads", "1", "--no-plots", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def mini_pair():
    return vlmspec_testbed.pair_paths("mini", "qwen2_vl")  # trained once and cached


@pytest.fixture(scope="module")
def pair_args(mini_pair):
    return ["--target", str(mini_pair[0]), "--draft", str(mini_pair[1])]


@pytest.fixture(scope="module")
def pipe(mini_pair):
    return VLMSpecPipeline.from_pretrained(*mini_pair, policy="ar", torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def qa_items():
    return load_inputs(["image_qa"], 2, seed=0, source="testbed")


@pytest.fixture(scope="module")
def sections(pair_args, tmp_path_factory):
    """One small bench with both sections: ar, sage, chain (and hf_assisted: not sampled) on two tasks; dsbd, which
    has no greedy row (--methods refuses it), in the --dsbd section."""
    out = tmp_path_factory.mktemp("bench_sampling")
    argv = [*pair_args, *FAST, "--tasks", "image_qa,image_caption", "--methods", "ar,hf_assisted,sage,chain",
            "--sampling", "--dsbd", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    return out, json.loads((out / "bench.json").read_text())


@pytest.fixture(autouse=True)
def one_thread():
    with bench.torch_threads(1):
        yield


def test_sampling_rows_per_method_and_task(sections):
    _, result = sections
    rows = {(r["method"], r["task"]): r for r in result["sampling_rows"]}
    assert set(rows) == {(m, t) for m in SAMPLING_METHODS for t in ("image_qa", "image_caption", "all")}
    settings = result["sampling_settings"]
    assert settings["methods"] == list(SAMPLING_METHODS)  # hf_assisted is not sampled
    assert settings["temperature"] == 1.0
    for row in rows.values():
        assert row["error"] is None, row
        assert row["runs"] == (4 if row["task"] == "all" else 2)  # inputs x repeats
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert row["tau"] is None or row["tau"] >= 0
        assert row["speedup"] > 0 and row["lossless"] is True
    for task in ("image_qa", "image_caption", "all"):
        assert rows["ar", task]["speedup"] == pytest.approx(1.0)
        assert rows["ar", task]["tau"] in (None, 0.0)
    caption = rows["sage", "image_caption"]  # a long reply: the trained draft gets tokens accepted
    assert caption["tau"] > 0 and caption["tokens_per_step"] == pytest.approx(caption["tau"] + 1, abs=1.0)


def test_dsbd_rows_measure_speed_perplexity_and_exact_match(sections):
    _, result = sections
    settings = result["dsbd_settings"]
    assert settings["task"] == "image_qa" and settings["references"] == settings["inputs"] == 1
    assert (settings["temperature"], settings["top_k"], settings["top_p"]) == (1.0, 10, 0.8)
    rows = {r["method"]: r for r in result["dsbd_rows"]}
    assert list(rows) == list(DSBD_METHODS)
    for row in rows.values():
        assert row["error"] is None, row
        assert row["runs"] == 2
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert row["perplexity"] >= 1.0
        assert 0.0 <= row["exact_match"] <= 1.0
    assert rows[BEAM_SAMPLING]["width"] == settings["beam_width"] >= 1
    assert rows[MULTINOMIAL]["width"] == 1
    assert rows[BEAM_SAMPLING]["speedup"] == pytest.approx(1.0)
    assert rows[DSBD]["tau"] is None or rows[DSBD]["tau"] >= 0


def test_sections_reach_markdown_csv_and_json(sections):
    out, result = sections
    md = (out / "bench.md").read_text()
    assert "## Sampling (temperature 1" in md and "## DSBD vs beam sampling (image_qa" in md
    assert "| method | task | budget | tau |" in md  # the greedy section is still there
    with (out / "bench_sampling.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(result["sampling_rows"]) == 9
    with (out / "bench_dsbd.csv").open() as handle:
        assert [r["method"] for r in csv.DictReader(handle)] == list(DSBD_METHODS)
    with (out / "bench.csv").open() as handle:  # the greedy CSV keeps only its rows
        methods = {r["method"] for r in csv.DictReader(handle)}
    assert methods == {"ar", "hf_generate", "hf_assisted", "sage", "chain"}


def test_same_seed_same_samples(pipe, qa_items):
    caption = load_inputs(["image_caption"], 1, seed=0, source="testbed")[0]
    for variant in build_variants(["ar", "sage"], None):
        first = run_sampled(pipe, variant, caption, MAX_NEW, repeat=0, seed=5)
        again = run_sampled(pipe, variant, caption, MAX_NEW, repeat=1, seed=5)
        assert first.error is None and first.token_ids and first.token_ids == again.token_ids, variant.key
    outputs = {tuple(run_sampled(pipe, variant, caption, MAX_NEW, 0, seed=s).token_ids) for s in range(4)}
    assert len(outputs) > 1  # it samples: different seeds give different replies
    policy = dsbd_policy()
    item = qa_items[0]
    assert (
        run_dsbd(pipe, policy, item, MAX_NEW, 0, 3).token_ids
        == run_dsbd(pipe, policy, item, MAX_NEW, 1, 3).token_ids
    )
    warping = dsbd_warping(policy)
    beams = [run_beam(pipe, BEAM_SAMPLING, 2, warping, item, MAX_NEW, r, seed=3).token_ids for r in (0, 1)]
    assert beams[0] and beams[0] == beams[1]


def test_explicit_beam_width_and_scores(pipe, qa_items):
    policy = dsbd_policy({"threshold": 0.7})
    runs, width, note = measure_dsbd(
        pipe, policy, qa_items[:1], 3, MAX_NEW, repeats=1, seed=0, log=lambda m: None
    )
    assert width == 3 and "--beam-width" in note
    assert {r.key: r.widths for r in runs if r.key != DSBD} == {BEAM_SAMPLING: [3], MULTINOMIAL: [1]}
    item = qa_items[0]
    run = runs[0]
    for reference, expected in ((f"  {run.text.strip()} ", True), (run.text.strip() + " x", False)):
        scored = replace(run, perplexity=None, exact_match=None)
        score_runs(pipe, [scored], [replace(item, reference=reference)])
        assert scored.exact_match is expected and scored.perplexity >= 1.0
    unreferenced = replace(run, exact_match=None)
    score_runs(pipe, [unreferenced], [replace(item, reference=None)])
    assert unreferenced.exact_match is None


def test_auto_beam_width_is_dsbds_mean_output_width():
    runs = [
        SampleRun(DSBD, "image_qa", 0, 0, 0, widths=[1, 4, 4]),
        SampleRun(DSBD, "image_qa", 1, 0, 0, widths=[2]),
    ]
    assert auto_beam_width(runs, w_min=1) == 3  # mean 2.75, rounded
    assert auto_beam_width([SampleRun(DSBD, "image_qa", 0, 0, 0)], w_min=2) == 2  # nothing drafted
    assert auto_beam_width([SampleRun(DSBD, "image_qa", 0, 0, 0, widths=[4], error="boom")], w_min=1) == 1


def test_sampling_variants_are_lossless_policies_only():
    keys = [v.key for v in sampling_variants(["hf_assisted", "dsbd", "sage", "chain"], 8)]
    assert keys == ["ar", "sage", "chain"]
    variants = sampling_variants(["ar", "sage", "static", "eagle2", "dsbd"], None)
    assert all(v.policy is None or v.policy.lossless for v in variants)
    assert sampling_markdown({}) == [] and dsbd_markdown({}) == []


def test_cli_flags_parse(pair_args):
    args = bench.build_parser().parse_args(
        [
            *pair_args,
            "--sampling",
            "--dsbd",
            "--beam-width",
            "3",
            "--dsbd-options",
            '{"threshold": 0.7, "gamma": 2}',
        ]
    )
    config = bench.config_from_args(args).validated()
    assert config.sampling and config.dsbd and config.beam_width == 3
    assert config.dsbd_options == {"threshold": 0.7, "gamma": 2}
    defaults = bench.config_from_args(bench.build_parser().parse_args(pair_args))
    assert (
        not defaults.sampling
        and not defaults.dsbd
        and defaults.beam_width is None
        and defaults.dsbd_options == {}
    )
    auto = bench.build_parser().parse_args([*pair_args, "--beam-width", "auto"])
    assert auto.beam_width is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--beam-width", "0"], "--beam-width must be >= 1, got 0"),
        (["--beam-width", "wide"], "--beam-width takes a positive integer or 'auto', got 'wide'"),
        (["--dsbd-options", "threshold=0.7"], "--dsbd-options takes a JSON object"),
        (["--dsbd-options", "[0.7]"], "--dsbd-options takes a JSON object, got '[0.7]'"),
    ],
)
def test_bad_flag_values_are_argparse_errors(pair_args, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.build_parser().parse_args([*pair_args, "--dsbd", *argv])
    assert exit_info.value.code == 1  # as every vlmspec command
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ('{"thresold": 0.7}', "unknown option(s) ['thresold']; valid options are"),
        ('{"threshold": 2}', "DSBDConfig.threshold=2 is invalid: a number in [0, 1]"),
        ('{"memory_mode": false}', "memory_mode=False is invalid"),
    ],
)
def test_bad_dsbd_options_stop_before_any_work(pair_args, options, message, capsys):
    assert bench.main([*pair_args, *FAST, "--dsbd", "--dsbd-options", options]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vlmspec bench: error: dsbd options") and message in err


def test_bad_beam_width_in_config():
    with pytest.raises(ValueError, match="beam width=0 is invalid"):
        bench.BenchConfig(beam_width=0).validated()
