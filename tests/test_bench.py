"""``vlmspec bench`` (``vlmspec_eval.bench``) on the tiny qwen2_vl pair: outputs, losslessness, cost probe, budgets."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch
from vlmspec_eval import bench, methods
from vlmspec_eval.analysis import lagged_autocorrelation, running_tau
from vlmspec_eval.cost import CostProbe, ideal_terms, run_cost_probe
from vlmspec_eval.methods import (
    DEFAULT_EDD_METHODS,
    ForwardCall,
    ForwardRecorder,
    RunRecord,
    Variant,
    build_variants,
    make_policy,
    resolve_methods,
    valid_methods,
)
from vlmspec_eval.report import REQUIRED_ROW_KEYS, aggregate
from vlmspec_eval.tasks import load_inputs, resolve_pair

from vlmspec import VLMSpecPipeline
from vlmspec import testbed as vlmspec_testbed
from vlmspec.named_pairs import ResolvedPair
from vlmspec.policies import MC_SIM_7B_63, available_policies
from vlmspec.testing import build_tiny_pair

FAST = ["--n", "1", "--repeats", "1", "--max-new-tokens", "8", "--probe-sizes", "1,2,4,8,16", "--probe-runs", "2",
        "--threads", "1", "--inputs", "synthetic", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def qwen_pair(tiny_root):
    return build_tiny_pair("qwen2_vl", root=tiny_root)


@pytest.fixture(scope="module")
def pair_args(qwen_pair):
    return ["--target", str(qwen_pair.target), "--draft", str(qwen_pair.draft)]


@pytest.fixture(scope="module")
def small_bench(pair_args, tmp_path_factory):
    """One small bench with plots: ar, hf_assisted, sage on all three tasks, a node budget and a short ablation."""
    out = tmp_path_factory.mktemp("bench")
    argv = [*pair_args, *FAST, "--methods", "ar,hf_assisted,sage", "--budget", "8", "--prune-ratios", "0,0.8",
            "--out", str(out / "run"), "--json", str(out / "extra.json")]  # fmt: skip
    assert bench.main(argv) == 0
    return out


def test_bench_writes_markdown_csv_json_and_plots(small_bench, capsys):
    run = small_bench / "run"
    for name in ("bench.md", "bench.csv", "bench.json", "speedup.png", "tau_vs_length.png", "entropy_autocorr.png",
                 "time_breakdown.png", "prune_ablation.png", "cost_probe.png"):  # fmt: skip
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    assert json.loads((small_bench / "extra.json").read_text()) == json.loads(
        (run / "bench.json").read_text()
    )
    md = (run / "bench.md").read_text()
    assert "| method | task | budget | tau |" in md and "hf_assisted" in md and "sage" in md
    with (run / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert (
        len(rows) == 4 * 3 + 2 * 3
    )  # 4 methods (hf_generate always runs) x 3 tasks + 2 prune ratios x 3 tasks


def test_bench_json_rows_are_complete_and_lossless(small_bench):
    result = json.loads((small_bench / "run" / "bench.json").read_text())
    assert {"pair", "device", "cost_probe", "rows"} <= set(result)
    rows = result["rows"]
    assert {(r["method"], r["task"]) for r in rows} == {
        (m, t)
        for m in ("ar", "hf_generate", "hf_assisted", "sage")
        for t in ("image_caption", "image_qa", "video_caption")
    }
    for row in rows:
        assert set(REQUIRED_ROW_KEYS) <= set(row), row["method"]
        assert row["error"] is None, row
        assert row["identical"] is True, f"{row['method']}/{row['task']} differs from AR"
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    for row in result["ablation"]:
        assert row["identical"] is True and row["error"] is None
    sage = [r for r in rows if r["method"] == "sage"]
    assert all(r["budget"] == 8 and 0 < r["nodes_per_step"] <= 8 for r in sage)
    assert all(r["tau"] > 0 and r["ideal_speedup"] is not None for r in sage)
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(r["speedup_ar"] == pytest.approx(1.0) and r["ideal_speedup"] == pytest.approx(1.0) for r in ar)
    hf = [r for r in rows if r["method"] == "hf_generate"]  # the speed-up baseline: transformers' generate()
    assert all(r["speedup"] == pytest.approx(1.0) and r["tokens_per_step"] == pytest.approx(1.0) for r in hf)
    probe = result["cost_probe"]
    assert probe["roofline"]["bandwidth"] > 0 and probe["roofline"]["peak_flops"] > 0
    assert all(r > 0 for r in probe["roofline_s"]) and probe["roofline"]["weight_bytes"] > 0
    assert all(0.0 <= r["overhead_share"] <= 1.0 for r in rows)


def test_bad_method_lists_valid_methods(pair_args, capsys):
    # a bad option exits 1, as in every vlmspec command
    assert bench.main([*pair_args, *FAST, "--methods", "ar,bogus", "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "bogus" in err
    for name in valid_methods():
        assert name in err
    with pytest.raises(ValueError, match="valid methods: ar, hf_generate, hf_assisted"):
        resolve_methods("nope")


def test_hf_assisted_failure_is_reported_in_its_row(pair_args, tmp_path, monkeypatch):
    def broken(pipe, inputs, max_new_tokens):
        raise RuntimeError("assisted generation is not supported for this family")

    monkeypatch.setattr(methods, "assisted_generate", broken)
    out = tmp_path / "run"
    argv = [
        *pair_args,
        *FAST,
        "--methods",
        "ar,hf_assisted",
        "--tasks",
        "image_qa",
        "--no-plots",
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    rows = {r["method"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert "not supported for this family" in rows["hf_assisted"]["error"]
    assert rows["hf_assisted"]["tokens_per_s"] is None
    assert rows["ar"]["error"] is None and rows["ar"]["identical"] is True
    assert not list(out.glob("*.png"))


@pytest.fixture(scope="module")
def saved_pipe(qwen_pair, tmp_path_factory):
    """The tiny pair saved by ``pipe.save_pretrained`` with chain settings (the bench must not take them)."""
    pipe = VLMSpecPipeline.from_pretrained(qwen_pair.target, qwen_pair.draft, policy="chain", gamma=3)
    return pipe.save_pretrained(tmp_path_factory.mktemp("saved") / "my-pipe")


def test_bench_takes_a_saved_pipelines_pair_with_its_own_settings(saved_pipe, tmp_path):
    out = tmp_path / "run"
    argv = ["--target", str(saved_pipe), *FAST, "--methods", "sage", "--tasks", "image_qa", "--prune-ratios", "none",
            "--no-plots", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["pair"]["source"] == f"pipeline:{saved_pipe}"
    assert (result["pair"]["target"], result["pair"]["draft"]) == (
        str(saved_pipe / "target"),
        str(saved_pipe / "draft"),
    )
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"ar", "hf_generate", "sage"}  # the bench's methods, not the saved chain policy
    assert rows["sage"]["error"] is None and rows["sage"]["identical"] is True


def test_a_saved_pipeline_without_a_draft_needs_draft(saved_pipe, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(saved_pipe, bare, ignore=shutil.ignore_patterns("draft"))
    with pytest.raises(ValueError, match="holds no draft/: give --draft"):
        bench.BenchConfig(target=str(bare)).validated()
    with_draft = resolve_pair(str(bare), str(saved_pipe / "draft"), "qwen2_vl")
    assert (with_draft.target, with_draft.draft) == (str(bare / "target"), str(saved_pipe / "draft"))
    with pytest.raises(ValueError, match="give both --target and --draft, a pair name or a saved pipeline"):
        bench.BenchConfig(target=str(saved_pipe / "target")).validated()


def test_cost_probe_times_increasing_tree_sizes(qwen_pair):
    pipe = VLMSpecPipeline.from_pretrained(
        qwen_pair.target, qwen_pair.draft, policy="ar", torch_dtype=torch.float32
    )
    item = load_inputs(["image_caption"], 1, seed=0, source="synthetic")[0]
    inputs = pipe.prepare_inputs(item.image, item.prompt, item.video)
    with bench.torch_threads(1):  # a parallel region on a shared CPU stalls on preempted threads
        probe = run_cost_probe(pipe, inputs, item.task, sizes=(16, 1, 4, 64), runs=2)
    assert probe.sizes == (1, 4, 16, 64)
    assert len(probe.target_s) == len(probe.draft_s) == 4
    assert all(t > 0 for t in probe.target_s + probe.draft_s)
    assert probe.prefix_tokens == inputs["input_ids"].shape[1]
    curve = probe.to_dict()["target_ratio"]
    assert curve[0] == 1.0 and curve == sorted(curve)  # the envelope never decreases


# ---- no models needed -------------------------------------------------------------------------------------------
def test_budget_modes_apply_to_every_policy_through_its_config():
    sage = make_policy("sage", 16)
    assert sage.config.n_max == 16 and sage.fixed == {"n_max"}  # the depth is still the machine's to fit
    assert make_policy("sage", None).config.node_budget == 32 and "n_max" in make_policy("sage", None).fixed
    paper = make_policy("sage_paper", 16)
    assert paper.config.n_max == 16 and len(paper.config.initial_paths) == 16
    assert make_policy("sage_paper", None).config.node_budget == 64
    static = make_policy("static", 10)
    assert static.config.paths == MC_SIM_7B_63[:10] and static.config.node_budget == 10
    chain = make_policy("chain", 10)
    assert chain.config == make_policy("chain", None).config and chain.config.node_budget is None
    steep = _probe([1.0, 1.1, 1.3, 1.8, 2.5, 4.0, 7.0], draft=[0.05] * 7)
    fitted = make_policy("sage", "auto", steep)
    assert fitted.config.n_max == steep.node_budget() == 7 and fitted.config.d_max == steep.depth_budget(7)
    variants = {v.key: v for v in build_variants(["ar", "hf_assisted", "sage"], 12, prune_ratios=(0.5,))}
    assert variants["sage"].policy.config.n_max == 12 and variants["sage"].budget == 12
    assert variants["sage@prune=0.5"].ablation and variants["sage@prune=0.5"].budget == 12
    assert variants["ar"].budget is None and variants["hf_assisted"].policy is None
    auto = {v.key: v for v in build_variants(["static", "eagle2", "pct"], "auto", costs=steep, factor=3.0)}
    assert {v.budget for v in auto.values()} == {15}  # equal automatic budgets


def test_budget_reaches_every_policy_with_a_node_budget():
    for name in available_policies():
        if name == "ar" or make_policy(name, None).config.budget_field is None:
            continue
        variant = build_variants([name], 24)[0]
        assert variant.error is not None or variant.budget == 24, name


def test_resolve_methods_always_runs_ar_first():
    assert resolve_methods("sage,hf_assisted") == ["ar", "hf_generate", "sage", "hf_assisted"]
    # dsbd: the --dsbd section; the EDD rows run when the pair has an EDD draft (dropped otherwise)
    assert resolve_methods(None) == [m for m in valid_methods() if m != "dsbd"] + list(DEFAULT_EDD_METHODS)
    assert resolve_methods("edd+chain") == ["ar", "hf_generate", "edd+chain"]
    assert "dsbd" in valid_methods()
    with pytest.raises(ValueError, match="'dsbd' has no greedy form.*--methods dsbd: .*bench it with --dsbd"):
        resolve_methods("dsbd")  # a row would be an error: the --dsbd section benches it
    assert "ar" not in valid_methods()[1:] and set(available_policies()) - {"ar"} <= set(valid_methods())


def _probe(target, draft=None):
    return CostProbe(
        sizes=(1, 2, 4, 8, 16, 32, 64), target_s=tuple(target), draft_s=tuple(draft) if draft else None,
        prefix_tokens=10, runs=1, task="t",
    )  # fmt: skip


def test_ideal_speedup_is_one_for_ar_and_prices_trees():
    probe = _probe([1.0, 1.0, 1.0, 1.2, 1.5, 2.0, 3.0], draft=[0.1] * 7)
    ar = RunRecord("ar", "ar", "t", 0, 0, token_ids=list(range(5)), steps=4,
                   calls=[ForwardCall("target", 10, 1.0, True)] + [ForwardCall("target", 1, 1.0, False)] * 4)  # fmt: skip
    num, den = ideal_terms(ar, probe)
    assert num / den == pytest.approx(1.0)
    # Two steps of a 7-node tree (8 tokens: 1.2 each) after 3 draft forwards each (0.1), 3 tokens per step.
    calls = [ForwardCall("target", 10, 1.0, True)] + [ForwardCall("draft", 2, 0.1, False)] * 6
    calls += [ForwardCall("target", 8, 1.2, False)] * 2
    spec = RunRecord("sage", "sage", "t", 0, 0, token_ids=list(range(7)), steps=2, calls=calls)
    num, den = ideal_terms(spec, probe)
    assert num / den == pytest.approx(6 * 1.0 / (2 * 1.2 + 6 * 0.1))


def test_an_edd_row_is_priced_with_its_own_drafts_probe():
    """The ideal speed-up of an ``edd+`` row prices its draft forwards with the EDD pipeline's probe (one layer),
    not with the separate draft's (a whole model), which the rows on the bench's own pipeline use."""
    separate, edd = _probe([1.0] * 7, draft=[0.5] * 7), _probe([1.0] * 7, draft=[0.05] * 7)
    calls = [ForwardCall("target", 10, 1.0, True)] + [ForwardCall("draft", 1, 0.1, False)] * 4
    calls += [ForwardCall("target", 5, 1.0, False)] * 2
    records = [
        RunRecord(key, key, "t", 0, 0, token_ids=list(range(8)), steps=2, calls=calls)
        for key in ("chain", "edd+chain")
    ]
    variants = [
        Variant("chain", "chain", None, None),
        Variant("edd+chain", "edd+chain", None, None, pipe=SimpleNamespace(costs=edd)),
    ]
    rows, _ = aggregate(records, variants, ["t"], {}, separate)
    ideal = {row["key"]: row["ideal_speedup"] for row in rows}
    # The 7 tokens after the prefill's at one target forward each, against 2 verifications and 4 draft levels.
    assert ideal == {
        "chain": pytest.approx(7 / (2 + 4 * 0.5)),
        "edd+chain": pytest.approx(7 / (2 + 4 * 0.05)),
    }


def test_running_tau_and_entropy_autocorrelation():
    assert running_tau([2, 0, 1], 8) == [None, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, None]
    rising = [[float(i) for i in range(20)]]
    corr = lagged_autocorrelation(rising, lags=(1, 2))
    assert corr[1] == pytest.approx(1.0) and corr[2] == pytest.approx(1.0)
    assert lagged_autocorrelation([[1.0, 2.0]], lags=(5,)) == {5: None}


def test_inputs_and_default_pair_come_from_the_testbed(monkeypatch):
    calls = []

    def sample(task, seed):
        calls.append((task, seed))
        return SimpleNamespace(task=task, prompt=f"{task} prompt", reference="ref", image="img", video=None)

    monkeypatch.setattr(vlmspec_testbed, "sample", sample)
    monkeypatch.setattr(vlmspec_testbed, "pair_paths", lambda size, family: (f"/t/{size}/{family}", "/d"))
    items = load_inputs(["image_qa", "video_caption"], 2, seed=5)
    assert calls == [("image_qa", 5), ("image_qa", 6), ("video_caption", 5), ("video_caption", 6)]
    assert {it.source for it in items} == {"testbed"} and items[0].prompt == "image_qa prompt"
    assert resolve_pair(None, None, "qwen2_vl", "base") == ResolvedPair(
        "/t/base/qwen2_vl", "/d", "testbed:base:qwen2_vl@cpu", "cpu"
    )
    assert resolve_pair("testbed-base", None, "llava_onevision").source == "testbed:base:llava_onevision"
    assert resolve_pair(None, None, "qwen2_vl", "mini", "none").source == "testbed:mini:qwen2_vl"
    assert resolve_pair("org/a", "org/b", "qwen2_vl").source == "explicit"
    synthetic = load_inputs(["video_caption"], 1, seed=0, source="synthetic")[0]
    assert synthetic.source == "synthetic" and synthetic.video is not None and synthetic.image is None
    with pytest.raises(ValueError, match="valid tasks"):
        load_inputs(["captioning"], 1, seed=0)


def test_calibration_applies_to_a_pair_name_or_is_refused(monkeypatch):
    monkeypatch.setattr(vlmspec_testbed, "pair_paths", lambda size, family: (f"/t/{size}/{family}", "/d"))
    ci = resolve_pair("testbed-mini", None, "qwen2_vl", calibration="ci")
    assert (ci.source, ci.calibration) == ("testbed:mini:qwen2_vl@ci", "ci")
    assert resolve_pair("testbed-mini@ci", None, "qwen2_vl", calibration="ci") == ci
    assert resolve_pair("testbed-mini", None, "qwen2_vl", calibration="none").calibration is None
    assert resolve_pair("testbed-mini", None, "qwen2_vl").calibration is None  # a pair name keeps its own
    refused = [
        ({"target": "testbed-mini", "calibration": "nosuch"}, "unknown calibration 'nosuch'; valid: cpu, ci"),
        ({"calibration": "nosuch"}, "unknown calibration 'nosuch'"),
        ({"target": "testbed-mini@cpu", "calibration": "ci"}, "names calibration 'cpu' but --calibration says 'ci'"),
        ({"target": "testbed-mini@cpu", "calibration": "none"}, "names calibration 'cpu' but --calibration says"),
        ({"target": "org/t", "draft": "org/d", "calibration": "ci"}, "is a folder or hub id"),
        ({"target": "testbed-mini", "size": "base"}, "--size base picks the default pair's size"),
    ]  # fmt: skip
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=None) as err:
            bench.BenchConfig(**kwargs).validated()
        assert message in str(err.value), kwargs
    bench.BenchConfig(target="org/t", draft="org/d", calibration="none").validated()  # as they are: honoured


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--throughput", "0"], "--throughput must be >= 1, got 0"),
        (["--throughput", "-1"], "--throughput must be >= 1, got -1"),
        (["--throughput", "none"], "--throughput takes a positive integer batch size, got 'none'"),
        (["--throughput", "2,1,1"], "--throughput gives batch size(s) [1] more than once in '2,1,1'"),
    ],
)
def test_throughput_batch_sizes_are_positive_integers(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 1 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (
            ["--throughput", "1", "--json", "x.json"],
            "--throughput runs the throughput section instead of the bench",
        ),
        (["--throughput", "1", "--conversation"], "does not honour --conversation"),
        (["--conversation", "--json", "x.json", "--sampling"], "does not honour --json, --sampling"),
        (["--conversation", "--methods", "sage"], "does not honour --methods"),
        (
            ["--throughput", "1", "--tasks", "image_caption", "--repeats", "5"],
            "does not honour --tasks, --repeats",
        ),
        (
            ["--conversation", "--budget", "16", "--prune-ratios", "0", "--no-plots"],
            "--budget, --prune-ratios, --no-plots",
        ),
        (
            ["--throughput", "1", "--throughput-policies", "sgae,chain"],
            "unknown --throughput-policies ['sgae']",
        ),
        (["--conversation", "--throughput-policies", "edd+ar"], "unknown --throughput-policies ['edd+ar']"),
        (
            ["--throughput", "1", "--throughput-policies", "sage,dsbd"],
            "['dsbd']: the sections decode greedily",
        ),
        (["--throughput", "1", "--inputs", "synthetic"], "does not honour --inputs"),
    ],
)
def test_sections_refuse_the_flags_they_do_not_honour(argv, refused, tmp_path, capsys):
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 1
    assert refused in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_throughput_section_compares_batched_generate_and_vlmspec(pair_args, tmp_path):
    argv = [*pair_args, "--n", "3", "--max-new-tokens", "8", "--threads", "1", "--quiet", "--out", str(tmp_path),
            "--throughput", "1,2", "--throughput-policies", "sage,chain"]  # fmt: skip
    assert bench.main(argv) == 0
    rows = [line for line in (tmp_path / "throughput.md").read_text().splitlines() if line.startswith("| hf_gen")
            or line.startswith("| vlmspec")]  # fmt: skip
    assert [row.split(" | ")[:2] for row in rows] == [
        [f"| {method}", size]
        for size in ("1", "2")
        for method in ("hf_generate", "vlmspec sage", "vlmspec chain")
    ]
    assert all(
        row.endswith("| 3/3 |") for row in rows if "vlmspec" in row
    )  # every caption is generate()'s own


def test_throughput_section_runs_edd_rows_beside_the_pair_s_own_draft(tmp_path):
    argv = ["--target", "testbed-base", "--calibration", "none", "--n", "2", "--max-new-tokens", "6", "--threads", "1",
            "--quiet", "--out", str(tmp_path), "--throughput", "2", "--throughput-policies", "chain,edd+chain"]  # fmt: skip
    assert bench.main(argv) == 0
    rows = [line.split(" | ") for line in (tmp_path / "throughput.md").read_text().splitlines()
            if line.startswith("| hf_gen") or line.startswith("| vlmspec")]  # fmt: skip
    assert [row[0] for row in rows] == ["| hf_generate", "| vlmspec chain", "| vlmspec edd+chain"]
    assert all(row[-1] == "2/2 |" for row in rows)  # the EDD draft's captions are generate()'s own too


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_conversation_section_reports_every_turn_with_cache_reuse(family, tiny_root, tmp_path, capsys):
    pair = build_tiny_pair(
        family, root=tiny_root
    )  # LLaVA-OV: a template that renders system parts its own way
    argv = ["--target", str(pair.target), "--draft", str(pair.draft), "--n", "2", "--max-new-tokens", "8", "--threads", "1", "--quiet", "--out", str(tmp_path),
            "--conversation", "--throughput-policies", "sage"]  # fmt: skip
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("conversations of 3 turns") == 1, printed  # the header, once
    text = (tmp_path / "conversation.md").read_text()
    assert text.startswith("pair explicit; 2 conversations of 3 turns; up to 8 new tokens per reply\n\n")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
            or line.startswith("| 3 |")]  # fmt: skip
    methods = [(row[0], row[1]) for row in rows if len(row) == 10]
    assert methods == [(f"| {t}", m) for t in "123" for m in ("generate()", "ar chat", "sage chat")]
    assert all(row[-1] == "2/2 |" for row in rows if len(row) == 10)  # every reply is generate()'s own
    cached = {(row[0], row[1]): int(row[3]) for row in rows if len(row) == 10}
    assert (
        cached[("| 1", "sage chat")] == 0
        and cached[("| 2", "sage chat")] > 0
        # LLaVA-OV tiles the first picture differently once the second joins it: turn 3 reuses only the text before
        # that picture, less than turn 2 reused
        and cached[("| 3", "ar chat")] > 0
        and (cached[("| 3", "ar chat")] > cached[("| 2", "ar chat")]) == (family == "qwen2_vl")
    )
    assert (
        len([row for row in rows if len(row) == 4]) == 3
    )  # the prefill table: fresh call against chat per turn


def test_python_m_bench_reports_a_bad_pair_in_one_line(tmp_path, capsys):
    (tmp_path / "t").mkdir(), (tmp_path / "d").mkdir()
    assert bench.main(["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vlmspec bench: error: target model folder") and "no config.json" in err
    assert "Traceback" not in err


def test_an_edd_row_asked_for_without_an_edd_draft_is_an_error_row(tmp_path):
    """``--methods edd+chain`` on a pair with no EDD draft: the row is there, saying why, not silently dropped."""
    argv = ["--target", "testbed-mini", "--methods", "edd+chain", "--n", "1", "--repeats", "1", "--max-new-tokens",
            "4", "--tasks", "image_caption", "--probe-sizes", "1,2", "--probe-runs", "1", "--prune-ratios", "none",
            "--no-plots", "--quiet", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = [
        line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| edd+chain |")
    ]
    assert rows and "no EDD draft ships for the testbed mini qwen2_vl target" in rows[-1]


def test_a_row_s_speedups_and_identical_column_come_from_its_runs():
    """The figures the bench prints: tokens/s over the baseline's on the same input and repeat (not inverted), and
    `identical` false as soon as one run's ids differ from the reference (AR: target.generate()'s; others: AR's)."""
    from vlmspec_eval.report import cell_row

    def run(key: str, method: str, ids: list[int], seconds: float, repeat: int = 0) -> methods.RunRecord:
        return methods.RunRecord(
            key, method, "image_caption", 0, repeat, token_ids=ids, total_s=seconds, steps=1
        )

    ar_runs = {(0, r): run("ar", methods.AR, [1, 2, 3, 4], 0.4, r) for r in range(2)}
    hf_runs = {(0, r): run("hf", methods.HF_GENERATE, [1, 2, 3, 4], 0.8, r) for r in range(2)}
    sage = methods.Variant("sage", "sage", None, 8)
    runs = [run("sage", "sage", [1, 2, 3, 4], 0.2, r) for r in range(2)]
    row = cell_row(sage, "image_caption", runs, ar_runs, {}, None, hf_runs)
    assert row["speedup"] == pytest.approx(4.0) and row["speedup_ar"] == pytest.approx(2.0)
    assert row["tokens_per_s"] == pytest.approx(20.0) and row["identical"] is True
    runs[1].token_ids = [1, 2, 3, 5]
    assert cell_row(sage, "image_caption", runs, ar_runs, {}, None)["identical"] is False
    ar = methods.Variant("ar", methods.AR, None, None)
    references = {("image_caption", 0): [1, 2, 3, 4]}
    assert (
        cell_row(ar, "image_caption", list(ar_runs.values()), ar_runs, references, None)["identical"] is True
    )
    references = {("image_caption", 0): [9]}
    assert (
        cell_row(ar, "image_caption", list(ar_runs.values()), ar_runs, references, None)["identical"] is False
    )


def test_a_structured_bench_compares_every_row_with_generate_under_xgrammar(pair_args, tmp_path):
    """--structured-outputs: every engine row is identical to hf_generate's reply with xgrammar's processor;
    hf_assisted has none, said in its row; a bad structure is one line, before any model work."""
    structure = {"regex": "[a-z]{2,5}( [a-z]{2,5}){1,3}"}
    out = tmp_path / "run"
    argv = [*pair_args, *FAST, "--methods", "ar,hf_assisted,sage,chain", "--tasks", "image_caption", "--no-plots",
            "--out", str(out), "--structured-outputs", json.dumps(structure)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert result["settings"]["structured_outputs"] == structure
    assert all(rows[m]["identical"] is True and rows[m]["error"] is None for m in ("ar", "sage", "chain"))
    assert "hf_assisted has no structured outputs" in rows["hf_assisted"]["error"]
    assert bench.main([*argv[:-1], '{"regex": 3}']) == 1


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_every_decoding_forward_is_timed_once(family, tiny_root):
    """The forward recorder sees each verification and each draft level once, whether the model's own ``forward``
    runs it (Qwen2-VL) or the adapter writes its decoder out (Qwen3.5's recurrent layers): one target forward a step,
    of the step's tree (its root and its nodes)."""
    from vlmspec.testing import make_image

    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    recorder = ForwardRecorder(
        pipe.target, pipe.draft, {"target": pipe.target_adapter, "draft": pipe.draft_adapter}
    )
    with recorder.recording():
        out = pipe(make_image(0), "Describe this image.", max_new_tokens=16)
    assert "run" not in vars(pipe.target_adapter) | vars(pipe.draft_adapter)  # the timed methods are removed
    verifies = [c for c in recorder.calls if c.role == "target" and not c.prefill]
    assert [c.tokens for c in verifies] == [size + 1 for size in out.stats.tree_sizes]
    assert sum(c.role == "draft" and not c.prefill for c in recorder.calls) >= out.stats.steps - 1
