"""Quantized targets and drafts (vlmspec.quantization): the reply stays the quantized target's own greedy
``generate()``; quantization configs are read and refused before any weights load; the command lines, the caption
job and the lmms-eval plugin take them. Quantized with optimum-quanto's int8 weights, which run on the CPU (a dev
dependency; torchao is not one: transformers would import it at every model load of every test process)."""

from __future__ import annotations

import argparse
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, input_kinds
from optimum.quanto import QModuleMixin
from transformers import AutoModelForImageTextToText, BitsAndBytesConfig, QuantoConfig

from vlmspec import VLMSpecPipeline
from vlmspec.errors import InvalidInputError
from vlmspec.kernels import onednn_available, onednn_linears
from vlmspec.probe import machine_description
from vlmspec.quantization import resolve_quantization_config
from vlmspec.testing import make_image

FAMILY = "qwen2_vl"
MAX_NEW = 32


def _quantized_layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, QModuleMixin) for m in model.modules())


@pytest.mark.parametrize("role", ["target", "draft", "self"])
def test_a_quantized_model_leaves_the_reply_the_target_s_own(tiny_pairs, role):
    """The target quantized (by name), the draft (transformers' config object), or the target's own checkpoint
    quantized as its draft ("self": self-speculation)."""
    pair = tiny_pairs[FAMILY]
    draft = pair.target if role == "self" else pair.draft
    option = (
        {"quantization_config": "quanto-int8"}
        if role == "target"
        else {"draft_quantization_config": QuantoConfig(weights="int8")}
    )
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target, draft, policy="sage", torch_dtype=torch.float32, **option
    )
    quantized, dense = (pipe.target, pipe.draft) if role == "target" else (pipe.draft, pipe.target)
    assert _quantized_layers(quantized) > 0 and _quantized_layers(dense) == 0
    ids = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]])}
    plain = AutoModelForImageTextToText.from_pretrained(pair.target if role == "target" else draft)
    assert not torch.equal(quantized(**ids).logits, plain(**ids).logits)  # the weights did change
    accepted = 0
    for kind, image, video in input_kinds():
        inputs = pipe.prepare_inputs(image, PROMPTS[0], video)
        expected = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
        out = pipe(image, PROMPTS[0], video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == expected[0, inputs["input_ids"].shape[1] :].tolist(), (
            f"{role} quantized/{kind}"
        )
        accepted += out.stats.accepted_tokens
    assert accepted > 0


def test_a_quantized_pipeline_is_probed_apart_and_saved_only_where_transformers_can(tiny_pairs, tmp_path):
    pair = tiny_pairs[FAMILY]
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", quantization_config="quanto-int8"
    )
    dense = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain")
    quantized_key, dense_key = (
        machine_description(p.target, p.draft, "k", {})["models"] for p in (pipe, dense)
    )
    assert quantized_key[0]["quantization"]["quant_method"] == "quanto" and "quantization" not in dense_key[0]
    assert quantized_key[1] == dense_key[1]  # the same dense draft
    with pytest.raises(
        InvalidInputError, match=r"^the target model is quantized with quanto, which transformers"
    ):
        pipe.save_pretrained(tmp_path / "pipe")
    self_draft = VLMSpecPipeline(
        dense.target, pipe.target, dense.processor, policy="chain"
    )  # quantized as draft
    with pytest.raises(
        InvalidInputError, match=r"^the draft model is .*from_pretrained\(folder, draft_quantization_"
    ):
        self_draft.save_pretrained(tmp_path / "pipe")
    assert not (tmp_path / "pipe").exists()  # refused before anything was written
    dense.save_pretrained(tmp_path / "pipe")  # the way it says: saved dense, quantized where it loads
    back = VLMSpecPipeline.from_pretrained(tmp_path / "pipe", quantization_config="quanto-int8")
    assert _quantized_layers(back.target) == _quantized_layers(pipe.target) > 0
    image = make_image(0)
    assert (
        back(image, PROMPTS[0], max_new_tokens=MAX_NEW).token_ids
        == pipe(image, PROMPTS[0]).token_ids[:MAX_NEW]
    )


class _Packed(torch.Tensor):
    """A weight that is not a dense tensor (as torchao's quantized weights: they report the dtype they stand
    for)."""


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN (mkldnn) CPU backend")
def test_a_layer_whose_weight_is_not_a_dense_tensor_keeps_its_kernel_inside_the_onednn_block():
    dense, packed = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    packed.weight = torch.nn.Parameter(packed.weight.detach().as_subclass(_Packed))
    assert packed.weight.dtype == torch.float32
    with onednn_linears(torch.nn.ModuleList([dense, packed])) as rerouted:
        assert rerouted == 1 and "forward" in vars(dense) and "forward" not in vars(packed)


def test_a_calibrated_pair_is_inflated_then_quantized():
    """The ``ci`` calibration inflates both models; each is then quantized (written out, loaded back quantized)."""
    from vlmspec.testbed.calibrate import lm_shape
    from vlmspec.testbed.shapes import get_calibration

    pipe = VLMSpecPipeline.from_pretrained(
        "testbed-mini@ci",
        policy="sage",
        quantization_config="quanto-int8",
        draft_quantization_config="quanto-int8",
    )
    calibration = get_calibration("ci")
    assert (lm_shape(pipe.target), lm_shape(pipe.draft)) == (calibration.target, calibration.draft)
    assert _quantized_layers(pipe.target) > 0 and _quantized_layers(pipe.draft) > 0
    assert "vlmspec-quantize-" not in Path("/proc/self/maps").read_text()  # the temporary files are not held
    assert "vlmspec-quantize-" not in pipe.target.name_or_path and pipe.target.dtype == torch.float32
    image = make_image(0)
    inputs = pipe.prepare_inputs(image, PROMPTS[0])
    expected = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    out = pipe(image, PROMPTS[0], max_new_tokens=MAX_NEW)
    assert (
        out.token_ids == expected[0, inputs["input_ids"].shape[1] :].tolist()
        and out.stats.accepted_tokens > 0
    )


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were loaded before the inputs were checked")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization_config": "int3"}, r"^quantization_config='int3' is invalid; give a .*quanto-int8: "),
        (
            {"quantization_config": {"quant_method": "nope"}},
            r"is not a quantization config transformers reads",
        ),
        ({"quantization_config": '{"quant_method": '}, r"^quantization_config='.*' is not valid JSON"),
        ({"draft_quantization_config": 8}, r"^draft_quantization_config=8 is invalid"),
        ({"draft_quantization_config": "quanto-int8", "policy": "ar"}, r"but no draft model loads here"),
        (
            {"load_in_8bit": True},
            r"^'load_in_8bit' is an .*BitsAndBytesConfig\(load_in_8bit=True\) \(or 'bnb-8bit'\)",
        ),
    ],
)
def test_a_quantization_the_pair_cannot_take_is_refused_before_any_weights_load(
    tiny_pairs, monkeypatch, options, message
):
    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", _no_weights)
    pair = tiny_pairs[FAMILY]
    draft = None if options.get("policy") == "ar" else pair.draft
    with pytest.raises(InvalidInputError, match=message):
        VLMSpecPipeline.from_pretrained(pair.target, draft, **{"policy": "chain", **options})


def test_names_and_dicts_become_transformers_configs():
    int8 = resolve_quantization_config("quanto-int8")
    assert isinstance(int8, QuantoConfig) and int8.weights == "int8"
    nf4 = resolve_quantization_config("bnb-4bit")
    assert isinstance(nf4, BitsAndBytesConfig) and nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4"
    as_json = resolve_quantization_config('{"quant_method": "bitsandbytes", "load_in_8bit": true}')
    assert isinstance(as_json, BitsAndBytesConfig) and as_json.load_in_8bit and not as_json.load_in_4bit
    assert resolve_quantization_config(int8) is int8 and resolve_quantization_config(None) is None


@pytest.mark.skipif(
    find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed: nothing is missing"
)
def test_a_quantization_whose_package_is_missing_is_named_before_any_weights_load(tiny_pairs, monkeypatch):
    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", _no_weights)
    pair = tiny_pairs[FAMILY]
    message = r"^draft_quantization_config \(bitsandbytes\) cannot be used here: .*requires bitsandbytes"
    with pytest.raises(InvalidInputError, match=message):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, draft_quantization_config="bnb-4bit")


def test_the_command_lines_the_caption_job_the_bench_and_lmms_eval_take_a_quantization(tiny_pairs):
    from vlmspec_caption.config import JobConfig, JobError
    from vlmspec_caption.models import load_pipeline as job_pipeline
    from vlmspec_eval.bench import BenchConfig, describe_pair
    from vlmspec_eval.lmms.options import parse_model_args
    from vlmspec_eval.tasks import load_config_pair

    from vlmspec.cli import build_parser, load_pipeline

    argv = ["demo", "--target", "tiny", "--quantization", "quanto-int8", "--policy", "chain"]
    args = build_parser().parse_args(argv)
    assert _quantized_layers(load_pipeline(args, "vlmspec demo").target) > 0
    bad = argparse.Namespace(**{**vars(args), "draft_quantization": "int3"})
    with pytest.raises(InvalidInputError, match=r"^--draft-quantization='int3' is invalid"):
        load_pipeline(bad, "vlmspec demo")
    no_draft = argparse.Namespace(**{**vars(args), "draft_quantization": "quanto-int8", "policy": "ar"})
    with pytest.raises(
        InvalidInputError, match=r"^--draft-quantization was given, but vlmspec demo runs no draft"
    ):
        load_pipeline(no_draft, "vlmspec demo")

    config = JobConfig.from_mapping(
        {"target": "tiny", "policy": "chain", "quantization": "quanto-int8"}, "test"
    )
    assert config.settings()["quantization"] == "quanto-int8"
    assert (
        "quantization" not in JobConfig.from_mapping({"quantization": "none"}, "flags", flags=True).settings()
    )
    pipe, _ = job_pipeline(config)
    assert _quantized_layers(pipe.target) > 0 and _quantized_layers(pipe.draft) == 0
    with pytest.raises(JobError, match=r"--draft-quantization=\{'load_in_4bit': True\} is invalid"):
        JobConfig.from_mapping({"draft_quantization": {"load_in_4bit": True}}, "flags", flags=True)

    assert parse_model_args({"target": "tiny", "quantization": "bnb-4bit"}).quantization == "bnb-4bit"
    with pytest.raises(InvalidInputError, match=r"^quantization='int3' is invalid"):
        parse_model_args({"target": "tiny", "quantization": "int3"})

    bench = BenchConfig(target="tiny", draft_quantization="quanto-int8").validated()
    pair, pipe = load_config_pair(bench)
    assert describe_pair(pipe, pair, bench.dtype)["quantization"] == {"target": None, "draft": "quanto"}
    with pytest.raises(InvalidInputError, match=r"^quantization='int3' is invalid"):
        BenchConfig(quantization="int3").validated()
