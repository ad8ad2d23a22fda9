"""Calibrated testbed pairs: exact inflation (token-identical greedy output), parameter counts against the real
language-model bodies, padded vocabulary rows that can never win, the shipped pairs and ``@<calibration>`` names."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmspec import named_pairs, testbed
from vlmspec.processors import LogitsProcessing
from vlmspec.sampling import SamplingParams
from vlmspec.testbed import calibrate
from vlmspec.testbed.calibrate import (
    CALIBRATIONS,
    REAL_BODIES,
    LMShape,
    body_parameters,
    exact_shape,
    inflate,
)
from vlmspec.testbed.data import encode
from vlmspec.testbed.tokenizer import build_processor
from vlmspec.testbed.train import model_spec

FAMILIES = testbed.FAMILIES
SMALL_REAL = {
    family: ("Qwen3-VL-2B", 4) if family == "qwen3_vl" else ("Qwen2-0.5B", 6) for family in FAMILIES
}
"""Per family, a real body (and how many of its layers: the real widths are what the test is about, and a few layers
keep it a few seconds; the trained body's four are the fewest) the greedy test inflates to: Qwen3-VL's heads can
only widen by a factor c with c % 3 == 1 (Qwen2-0.5B's 64-wide heads are 2x its 32), so four layers of
Qwen3-VL-2B's 28, and six of Qwen2-0.5B's 24.
The greedy test takes these real shapes for one family per language model (every other family's language model is
Qwen2's, inflated by the same mapping); every family is inflated to the ``cpu`` shape there."""
HELD_OUT_SEED = 4242  # below 10^9: never trained on


def _load(size: str, family: str, role: str = "target"):
    folder = getattr(testbed.build(size, family), role)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


TEXT_PROMPTS = ("Describe a large red circle.", "Describe a small blue square and a large red circle.")
"""Text-only chats: a trained target answers one of them at length, where it may answer another in a few words."""


def _held_out_inputs(processor) -> dict[str, dict]:
    """A held-out picture, a held-out clip and the text-only chats (``text0``, ...), as ``generate()`` inputs."""
    inputs = {
        task: encode(processor, [testbed.sample(task, seed=HELD_OUT_SEED)], with_reply=False)
        for task in ("image_caption", "video_caption")
    }
    for i, text in enumerate(TEXT_PROMPTS):
        chat = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        inputs[f"text{i}"] = processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
    return inputs


def _greedy(model, inputs, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _body(model) -> int:
    return sum(
        p.numel() for n, p in model.named_parameters() if ".language_model." in n and "embed_tokens" not in n
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "shape", "max_new_tokens"),
    [(family, "cpu", 16) for family in FAMILIES]
    + [(family, SMALL_REAL[family], 12) for family in ("qwen2_vl", "qwen3_vl")],
)
def test_inflated_target_gives_the_trained_targets_greedy_tokens(family, shape, max_new_tokens):
    target, processor = _load("base", family)
    if shape in CALIBRATIONS:
        named = CALIBRATIONS[shape].target
    else:
        named = REAL_BODIES[shape[0]]
        named = replace(named, layers=shape[1] or named.layers)
    inflated = inflate(target, named)
    # vocabulary aside: the body (layers + final norm) within 1% of the named shape's
    assert abs(_body(inflated) / body_parameters(named) - 1) < 0.01
    assert inflated.config.get_text_config().hidden_size == named.hidden
    compared = set()
    for name, inputs in _held_out_inputs(processor).items():
        expected = _greedy(target, inputs, max_new_tokens)
        if len(expected) < 8:  # too short to tell: a text chat the target answers in a few words
            assert name.startswith("text"), name
            continue
        assert _greedy(inflated, inputs, max_new_tokens) == expected, name
        compared.add(name.rstrip("0123456789"))
    assert compared == {"image_caption", "video_caption", "text"}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])  # the Qwen2 shapes, and Qwen3-VL's 32-wide heads
@pytest.mark.parametrize("size", ["base", "mini"])
@pytest.mark.parametrize("calibration", list(CALIBRATIONS))
def test_every_calibration_matches_its_real_body_within_one_percent(size, calibration, family):
    cal = CALIBRATIONS[calibration]
    interleaved = family == "qwen3_vl"
    for role, named in (("target", cal.target), ("draft", cal.draft)):
        if named is None:
            continue
        spec = model_spec(family, testbed.SIZES[size], role)
        heads = spec.hidden // spec.head_dim
        old = LMShape(
            spec.hidden, spec.intermediate, spec.layers, heads, spec.kv_heads, spec.head_dim,
            interleaved_rope=interleaved,
        )  # fmt: skip
        if (
            interleaved and (named.head_dim // spec.head_dim) % 3 != 1
        ):  # 64-wide heads: Qwen3-VL cannot go there
            with pytest.raises(ValueError, match="interleaved M-RoPE"):
                exact_shape(old, named)
            continue
        exact = exact_shape(old, named)
        assert exact.heads == named.heads and exact.hidden == named.hidden and exact.layers == named.layers
        assert abs(body_parameters(exact) / body_parameters(named) - 1) < 0.01, (role, exact)


def test_body_parameter_formula_counts_the_real_transformers_model():
    """``body_parameters`` is what transformers builds for that shape (checked on the meta device, 8B included;
    Qwen3-VL's language model is a Qwen3)."""
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model

    for shape in REAL_BODIES.values():
        config_cls, model_cls = (Qwen3Config, Qwen3Model) if shape.qk_norm else (Qwen2Config, Qwen2Model)
        config = config_cls(
            hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
            head_dim=shape.head_dim,
        )  # fmt: skip
        with torch.device("meta"):
            model = model_cls(config)
        body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
        assert body == body_parameters(shape), shape.name


def test_known_real_totals():
    """Body plus vocabulary gives the published sizes (7.6B, 1.5B, 3.1B, 0.49B; Qwen3-VL's language models are
    Qwen3-8B's and Qwen3-1.7B's: 8.19B and 1.72B)."""
    totals = {
        name: body_parameters(s) + s.vocab * s.hidden * (1 if s.tied else 2)
        for name, s in REAL_BODIES.items()
    }
    assert round(totals["Qwen2-7B"] / 1e9, 1) == 7.6
    assert round(totals["Qwen2-1.5B"] / 1e9, 2) == 1.54
    assert round(totals["Qwen2.5-3B"] / 1e9, 2) == 3.09
    assert round(totals["Qwen2-0.5B"] / 1e6) == 494
    assert round(totals["Qwen3-VL-8B"] / 1e9, 2) == 8.19
    assert round(totals["Qwen3-VL-2B"] / 1e9, 2) == 1.72


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_vocabulary_rows_can_never_win(family):
    target, _ = _load("mini", family)
    old_vocab = target.config.get_text_config().vocab_size
    inflated = inflate(target, LMShape(512, 512, 4, 4, 2, 128, vocab=old_vocab + 300))
    head = inflated.lm_head.weight.detach()
    never = calibrate._never_emitted_token(target)
    torch.manual_seed(0)
    hidden = torch.randn(2000, head.shape[1]) * torch.logspace(-3, 3, 2000)[:, None]
    hidden[:1000] = head[never] * torch.logspace(-2, 2, 1000)[:, None]  # the hard case: pads tie the maximum
    logits = hidden @ head.T
    # a padded logit is exactly the never-emitted image token's logit, so it is at most the real maximum ...
    assert torch.equal(logits[:, old_vocab:], logits[:, never, None].expand(-1, 300))
    ties = logits[:, never] == logits.max(-1).values
    assert ties.sum() > 100  # ... and where it is the maximum, argmax takes the first (real) index
    assert (logits.argmax(-1) < old_vocab).all() and (logits.argmax(-1)[ties] == never).all()
    processing = LogitsProcessing.for_call(inflated.generation_config, ())
    assert processing.suppress_tokens == tuple(range(old_vocab, old_vocab + 300))
    processed = processing.start(torch.tensor([0]), logits.shape[-1])
    params = SamplingParams.resolve(inflated.generation_config, top_k=0)
    assert params.probs(torch.stack([processed.first(row) for row in logits[:50]]))[:, old_vocab:].sum() == 0


def test_inflate_refuses_a_smaller_shape_with_the_reason():
    from vlmspec import VLMSpecPipeline

    target, _ = _load("mini", "qwen2_vl")
    with pytest.raises(ValueError, match="hidden 128 > 64"):
        inflate(target, LMShape(64, 512, 4, 2, 1, 32))
    with pytest.raises(ValueError, match="heads \\* head_dim"):
        LMShape(100, 512, 4, 2, 1, 32)
    qwen3, _ = _load("mini", "qwen3_vl")  # 32-wide heads: x2 would move rotary pairs to other axes
    with pytest.raises(ValueError, match="interleaved M-RoPE .* c % 3 == 1, not 2"):
        inflate(qwen3, REAL_BODIES["Qwen2-0.5B"])
    with pytest.raises(ValueError, match="interleaved M-RoPE"):
        VLMSpecPipeline.from_pretrained("testbed-mini:qwen3_vl@7b-0.5b")  # before building the 7B target


def test_calibrated_pair_names_resolve_and_load():
    pair = named_pairs.resolve_pair("testbed-mini:llava_onevision@cpu")
    assert pair.calibration == "cpu" and pair.source == "testbed:mini:llava_onevision@cpu"
    assert named_pairs.is_pair_name("testbed-base@7b-0.5b")
    assert named_pairs.resolve_pair(None).calibration == "cpu"  # the embedded default is calibrated
    with pytest.raises(ValueError, match="unknown calibration 'h100'.*cpu"):
        named_pairs.resolve_pair("testbed-mini@h100")

    from vlmspec import VLMSpecPipeline

    pipe = VLMSpecPipeline.from_pretrained("testbed-mini@cpu", policy="chain")
    assert pipe.target.config.get_text_config().hidden_size == CALIBRATIONS["cpu"].target.hidden
    assert (
        pipe.draft.config.get_text_config().hidden_size == testbed.SIZES["mini"].draft.hidden
    )  # cpu keeps it
    example = testbed.sample("image_caption", seed=HELD_OUT_SEED)
    out = pipe(example.image, example.prompt, max_new_tokens=24)
    assert out.stats.lossless and out.stats.new_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["base", "mini"])
def test_trained_pairs_ship_with_the_package(family, size):
    shipped = testbed.shipped_pair(size, family)
    assert shipped is not None and shipped.folder.is_relative_to(testbed.SHIPPED_ROOT)
    assert testbed.build(size, family).folder == shipped.folder  # no training, no cache
    assert shipped.manifest["testbed_version"] == testbed.TESTBED_VERSION
    assert (shipped.target / "model.safetensors").is_file() and (
        shipped.draft / "model.safetensors"
    ).is_file()
    assert "bit for bit" in testbed.compare_with_shipped(shipped)


def test_demo_on_a_calibrated_pair_says_what_the_calibration_is(capsys):
    from vlmspec.cli import main as cli_main

    assert cli_main(["demo", "--pair", "testbed-mini@cpu", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "Using the named pair (testbed:mini:qwen2_vl@cpu)" in out
    assert "calibration: cpu: the trained target inflated exactly" in out
    assert "transformers generate():" in out and "output vs generate(): identical; speed-up" in out


def test_an_edd_draft_trained_on_the_calibrated_target_loads_as_it_is(tmp_path):
    """A draft trained for the inflated target (`vlmspec edd train --target testbed-mini@ci`) is taken as it is; the
    shipped drafts, trained for the base target, are inflated with it (test_edd.py)."""
    from vlmspec import VLMSpecPipeline
    from vlmspec.errors import InvalidInputError
    from vlmspec.models import EDDDraft

    pipe = VLMSpecPipeline.from_pretrained("testbed-mini@ci", policy="ar")
    EDDDraft.for_target(pipe.target).save_pretrained(tmp_path / "edd")
    loaded = VLMSpecPipeline.from_pretrained("testbed-mini@ci", tmp_path / "edd", policy="chain", gamma=2)
    hidden = pipe.target.config.get_text_config().hidden_size
    assert loaded.draft.config.hidden_size == hidden
    example = testbed.sample("image_caption", 0)
    out = loaded(example.image, example.prompt, max_new_tokens=12)
    assert out.token_ids == loaded.reference_generate(
        loaded.prepare_inputs(example.image, example.prompt), 12
    )
    with pytest.raises(InvalidInputError, match=r"calibration='cpu' contradicts the pair name's '@ci'"):
        VLMSpecPipeline.from_pretrained("testbed-mini@ci", calibration="cpu")


def test_deepstack_layers_stay_in_place_and_the_function_with_them():
    """Qwen3-VL adds each DeepStack level's vision features after language-model layer 0, 1, ...: those layers keep
    their indices, the others spread (3 levels, 5 -> 9 layers); a random model with them inflates exactly (GQA
    copies, Qwen3's query/key norms and interleaved M-RoPE included)."""
    from vlmspec.testbed.models import ModelSpec, build_config, model_class

    assert calibrate._layer_positions(5, 9, 3) == [0, 1, 2, 3, 6]
    assert calibrate._layer_positions(4, 8) == [0, 2, 4, 6]
    processor = build_processor("qwen3_vl")
    spec = ModelSpec(hidden=64, layers=5, kv_heads=1, intermediate=96, vision_hidden=32, vision_layers=3,
                     vision_heads=2, head_dim=32, init_std=0.2)  # fmt: skip
    config = build_config("qwen3_vl", spec, processor.tokenizer)
    config.vision_config.deepstack_visual_indexes = [0, 1, 2]
    torch.manual_seed(0)
    model = model_class("qwen3_vl")(config).eval()
    for param in model.parameters():  # norms and biases away from their initial 1 and 0
        if param.ndim == 1:
            param.data.uniform_(0.5, 1.5)
    inflated = inflate(model, LMShape(256, 256, 9, 2, 2, 128, qk_norm=True))
    assert (
        calibrate._deepstack_levels(model) == 3 and inflated.config.get_text_config().num_key_value_heads == 2
    )
    inputs = encode(processor, [testbed.sample("image_caption", seed=HELD_OUT_SEED)], with_reply=False)
    with torch.no_grad():
        expected, got = model(**inputs).logits, inflated(**inputs).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
