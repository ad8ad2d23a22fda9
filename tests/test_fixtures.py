"""Checks that the tiny fixtures in :mod:`vlmspec.testing` behave like real VLM checkpoints.

Every pair is built once per session into a temporary cache, loaded back through
``AutoModelForImageTextToText``/``AutoProcessor.from_pretrained`` and driven through the real
processor + ``generate()`` for the input kinds the SDK supports.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmspec import testing
from vlmspec.testing import FAMILIES, TinyPair, build_tiny_pair

NEW_TOKENS = 48
INPUT_KINDS = testing.INPUT_KINDS

# Visual placeholder tokens per input kind for the default 56x56 pictures / 4-frame clips.
#  Qwen2/2.5-VL: 56x56 -> 4x4 patches of 14 -> 2x2 merged = 4 tokens; video (2, 4, 4) -> 8 tokens.
#  Qwen3-VL: 56x56 -> resized 64x64 -> 4x4 patches of 16 -> 4 tokens; video 2 x (4 tokens).
#  LLaVA-OV: one image -> anyres 2x2 grid of 28px crops: 4 base + 16 + 4 newlines = 24 tokens;
#  multi-image prompts use base features + newline = 5 tokens each; video 4 frames x 1 pooled + 1.
#  InternVL: tiles of 28px, 4x4 patches of 7, pixel-shuffled 2x2 -> 4 tokens per tile; 56x56 -> 2x2 tiles + a
#  thumbnail = 20 tokens; a video is 4 frames of one tile each.
EXPECTED_VISUAL_TOKENS = {
    "qwen2_vl": {"image": 4, "two_images": 8, "video": 8, "text": 0},
    "qwen2_5_vl": {"image": 4, "two_images": 8, "video": 8, "text": 0},
    "qwen3_vl": {"image": 4, "two_images": 8, "video": 8, "text": 0},
    "llava_onevision": {"image": 24, "two_images": 10, "video": 5, "text": 0},
    "internvl": {"image": 20, "two_images": 40, "video": 16, "text": 0},
}


@dataclass
class Loaded:
    """A fixture pair loaded back from disk."""

    pair: TinyPair
    target: Any
    draft: Any
    processor: Any
    draft_processor: Any


@pytest.fixture(scope="module")
def cache_root(tiny_root: Path) -> Path:
    return tiny_root


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request: pytest.FixtureRequest, cache_root: Path) -> Loaded:
    pair = build_tiny_pair(request.param, root=cache_root)
    target = AutoModelForImageTextToText.from_pretrained(pair.target).eval()
    draft = AutoModelForImageTextToText.from_pretrained(pair.draft).eval()
    return Loaded(
        pair=pair,
        target=target,
        draft=draft,
        processor=AutoProcessor.from_pretrained(pair.target),
        draft_processor=AutoProcessor.from_pretrained(pair.draft),
    )


@pytest.fixture(scope="module", autouse=True)
def _single_thread() -> Any:
    # Tiny models: intra-op threads only add overhead (and thrash on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Run:
    """One fp32 greedy generation of the target."""

    inputs: Any
    sequence: torch.Tensor  # prompt + NEW_TOKENS
    scores: torch.Tensor  # (NEW_TOKENS, vocab) fp32 logits used by greedy search

    @property
    def prompt_len(self) -> int:
        return self.inputs["input_ids"].shape[1]

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.sequence[0, self.prompt_len :]


@pytest.fixture(scope="module")
def target_runs(loaded: Loaded) -> dict[str, Run]:
    """Target greedy generations for every input kind, shared by the tests below."""
    runs = {}
    for kind in INPUT_KINDS:
        inputs = build_inputs(loaded.processor, kind)
        with torch.no_grad():
            out = loaded.target.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_scores=True,
                return_dict_in_generate=True,
            )
        runs[kind] = Run(inputs=inputs, sequence=out.sequences, scores=torch.stack(out.scores)[:, 0].float())
    return runs


def build_inputs(processor: Any, kind: str, video_path: Path | None = None) -> Any:
    """The canonical inputs of ``vlmspec.testing.make_inputs`` plus a video read from an mp4 file."""
    if kind != "mp4":
        return testing.make_inputs(processor, kind)
    assert video_path is not None
    frames, metadata = testing.read_video(video_path)  # videos=[path] would need torchcodec
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Summarize the video."}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt")


def _visual_token_count(loaded: Loaded, inputs: Any) -> int:
    config = loaded.target.config
    ids = inputs["input_ids"]
    placeholders = {getattr(config, name, None) for name in ("image_token_id", "video_token_id")} - {None}
    return int(torch.isin(ids, torch.tensor(sorted(placeholders))).sum())


def _special_ids(processor: Any) -> set[int]:
    return set(processor.tokenizer.all_special_ids)


def _full_forward_logits(model: Any, inputs: Any, sequence: torch.Tensor) -> torch.Tensor:
    """Logits predicting each generated token from ONE forward over prompt + generation."""
    prompt_len = inputs["input_ids"].shape[1]
    kwargs = dict(inputs)
    kwargs["input_ids"] = sequence
    kwargs["attention_mask"] = torch.ones_like(sequence)
    if "mm_token_type_ids" in kwargs:
        extra = torch.zeros(1, sequence.shape[1] - prompt_len, dtype=inputs["mm_token_type_ids"].dtype)
        kwargs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], extra], dim=1)
    with torch.no_grad():
        return model(**kwargs).logits[0, prompt_len - 1 : -1].float()


def _to_dtype(inputs: Any, dtype: torch.dtype) -> dict[str, Any]:
    return {
        k: v.to(dtype) if torch.is_tensor(v) and torch.is_floating_point(v) else v for k, v in inputs.items()
    }


# ---------------------------------------------------------------------------------------------
# Cheap checks (no model loading)
# ---------------------------------------------------------------------------------------------
def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama_vision") as info:
        build_tiny_pair("llama_vision", root=tmp_path)
    for family in FAMILIES:
        assert family in str(info.value)
    with pytest.raises(ValueError, match="qwen2_vl"):
        testing.build_processor("nope")


def test_media_helpers_are_deterministic(tmp_path: Path) -> None:
    import decord

    image = testing.make_image(3)
    assert image.size == (56, 56) and image.mode == "RGB"
    assert image.tobytes() == testing.make_image(3).tobytes()
    assert image.tobytes() != testing.make_image(4).tobytes()
    assert testing.make_image(0, size=(64, 48)).size == (64, 48)
    frames = testing.make_video_frames(1, num_frames=6)
    assert len(frames) == 6 and frames[0].tobytes() != frames[-1].tobytes()

    path = testing.write_video(tmp_path / "clip.mp4", frames, fps=4)
    reader = decord.VideoReader(str(path))
    assert len(reader) == 6 and reader[0].shape == (56, 56, 3)
    decoded, metadata = testing.read_video(path)
    assert decoded.shape == (6, 56, 56, 3) and metadata.fps == pytest.approx(4.0)


def test_processor_tokenizer_encodes_any_text() -> None:
    for family in FAMILIES:
        tokenizer = testing.build_processor(family).tokenizer
        text = "Describe this image. Ünïcødé ☃ 日本語 <tag> 12345"
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert len(tokenizer("Describe this image.")["input_ids"]) <= 5  # learned merges, not bytes


# ---------------------------------------------------------------------------------------------
# Per-family checks on the saved checkpoints
# ---------------------------------------------------------------------------------------------
def test_pair_is_saved_and_reused(loaded: Loaded, cache_root: Path) -> None:
    pair = loaded.pair
    assert pair.target.parent == pair.draft.parent
    assert testing.FIXTURE_VERSION in pair.target.parent.name and "seed0" in pair.target.parent.name
    for folder in (pair.target, pair.draft):
        assert (folder / "model.safetensors").is_file()
        assert (folder / "config.json").is_file() and (folder / "generation_config.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        assert (pair.target / name).read_bytes() == (pair.draft / name).read_bytes(), name
    before = (pair.target / "model.safetensors").stat().st_mtime_ns
    again = build_tiny_pair(pair.family, root=cache_root)
    assert again == pair
    assert (pair.target / "model.safetensors").stat().st_mtime_ns == before  # reused, not rebuilt


def test_config_matches_tokenizer(loaded: Loaded) -> None:
    family = loaded.pair.family
    expected_class = {
        "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
        "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
        "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
        "llava_onevision": ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionProcessor"),
        "internvl": ("InternVLForConditionalGeneration", "InternVLProcessor"),
    }[family]
    assert (type(loaded.target).__name__, type(loaded.processor).__name__) == expected_class
    assert type(loaded.draft) is type(loaded.target)

    tokenizer = loaded.processor.tokenizer
    assert tokenizer.get_vocab() == loaded.draft_processor.tokenizer.get_vocab()
    tok = tokenizer.convert_tokens_to_ids
    for model in (loaded.target, loaded.draft):
        config = model.config
        assert config.get_text_config().vocab_size == len(tokenizer)
        if family == "llava_onevision":
            assert (config.image_token_id, config.video_token_id) == (tok("<image>"), tok("<video>"))
            assert config.vision_feature_select_strategy == "full"
        elif family == "internvl":
            assert config.image_token_id == tok("<IMG_CONTEXT>") == loaded.processor.image_token_id
            assert config.image_seq_length == loaded.processor.image_seq_length == 4
        else:
            assert config.image_token_id == tok("<|image_pad|>")
            assert config.video_token_id == tok("<|video_pad|>")
            assert config.vision_start_token_id == tok("<|vision_start|>")
            assert config.vision_end_token_id == tok("<|vision_end|>")
            text_config = config.get_text_config()
            section = text_config.rope_parameters["mrope_section"]
            head_dim = (
                getattr(text_config, "head_dim", None)
                or text_config.hidden_size // text_config.num_attention_heads
            )
            assert sum(section) == head_dim // 2
        generation = model.generation_config
        assert tok("<|im_end|>") in generation.eos_token_id
        assert generation.pad_token_id == tok("<|endoftext|>") and generation.do_sample is False
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"

    n_target = sum(p.numel() for p in loaded.target.parameters())
    n_draft = sum(p.numel() for p in loaded.draft.parameters())
    assert n_draft < n_target
    assert (
        loaded.draft.config.get_text_config().num_hidden_layers
        < loaded.target.config.get_text_config().num_hidden_layers
    )


def test_chat_template_renders_family_style(loaded: Loaded) -> None:
    family = loaded.pair.family
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}
    ]
    text = loaded.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if family == "llava_onevision":
        assert text == "<|im_start|>user <image>\nDescribe this image.<|im_end|><|im_start|>assistant\n"
    elif family == "internvl":
        assert (
            text == "<|im_start|>user\n<IMG_CONTEXT>\nDescribe this image.<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        assert text == (
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    plain = loaded.processor.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False, tokenize=False
    )
    assert "hi" in plain and "assistant" not in plain


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_generate_every_input_kind(loaded: Loaded, target_runs: dict[str, Run], kind: str) -> None:
    family = loaded.pair.family
    run = target_runs[kind]
    if family not in ("llava_onevision", "internvl"):
        # Qwen processors return it by default (return_mm_token_type_ids=True class attribute).
        assert "mm_token_type_ids" in run.inputs
        assert run.inputs["mm_token_type_ids"].shape == run.inputs["input_ids"].shape
    assert _visual_token_count(loaded, run.inputs) == EXPECTED_VISUAL_TOKENS[family][kind]

    with torch.no_grad():
        draft_out = loaded.draft.generate(**run.inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    special = _special_ids(loaded.processor)
    for new in (run.new_tokens.tolist(), draft_out[0, run.prompt_len :].tolist()):
        assert len(new) == NEW_TOKENS  # never stops early: EOS/special lm_head rows are zero
        assert not special.intersection(new)
        assert len(set(new)) > 3  # not a single repeated token


def test_video_from_mp4_file(loaded: Loaded, tmp_path: Path) -> None:
    path = testing.write_video(tmp_path / "clip.mp4", testing.make_video_frames(5), fps=4)
    inputs = build_inputs(loaded.processor, "mp4", video_path=path)
    assert _visual_token_count(loaded, inputs) == EXPECTED_VISUAL_TOKENS[loaded.pair.family]["video"]
    with torch.no_grad():
        out = loaded.target.generate(**inputs, do_sample=False, max_new_tokens=8)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8


def test_outputs_depend_on_visual_input(loaded: Loaded, target_runs: dict[str, Run]) -> None:
    """Images must matter, or bugs in visual-token handling would go unnoticed."""
    reference = target_runs["image"]
    text = loaded.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    changed = 0
    for seed in (11, 12, 13, 14, 15):
        inputs = loaded.processor(text=[text], images=[testing.make_image(seed)], return_tensors="pt")
        with torch.no_grad():
            out = loaded.target.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
        changed += not torch.equal(out[0, reference.prompt_len :], reference.new_tokens)
    assert changed >= 1


def test_outputs_depend_on_context(loaded: Loaded, target_runs: dict[str, Run]) -> None:
    """Teacher-forced predictions must change with the prompt (KV-cache bugs must show)."""
    changed = 0
    for kind, other in zip(INPUT_KINDS, INPUT_KINDS[1:] + INPUT_KINDS[:1], strict=False):
        run, other_inputs = target_runs[kind], target_runs[other].inputs
        sequence = torch.cat([other_inputs["input_ids"], run.new_tokens[None]], dim=1)
        predictions = _full_forward_logits(loaded.target, other_inputs, sequence).argmax(-1)
        changed += int((predictions[1:] != run.new_tokens[1:]).sum())  # same previous token, other context
    assert changed >= 2


def test_greedy_decoding_is_well_conditioned(loaded: Loaded, target_runs: dict[str, Run]) -> None:
    """Peaked logits, bf16 full == incremental argmax, and a useful draft/target agreement."""
    target_bf16 = AutoModelForImageTextToText.from_pretrained(loaded.pair.target, dtype=torch.bfloat16).eval()
    relative_margins: list[float] = []
    agreements: list[float] = []
    for kind, run in target_runs.items():
        top2 = run.scores.topk(2, dim=-1).values
        relative_margins += ((top2[:, 0] - top2[:, 1]) / run.scores.std(dim=-1)).tolist()
        draft_logits = _full_forward_logits(loaded.draft, run.inputs, run.sequence)
        agreements.append((draft_logits.argmax(-1) == run.new_tokens).float().mean().item())

        # bf16: token-by-token generation with KV cache vs one forward over the whole sequence.
        inputs_bf16 = _to_dtype(run.inputs, torch.bfloat16)
        with torch.no_grad():
            sequence = target_bf16.generate(**inputs_bf16, do_sample=False, max_new_tokens=NEW_TOKENS)
        full = _full_forward_logits(target_bf16, inputs_bf16, sequence)
        assert torch.equal(full.argmax(-1), sequence[0, run.prompt_len :]), f"bf16 argmax mismatch for {kind}"

    assert statistics.median(relative_margins) > 1.5  # top1 beats top2 by > 1.5 logit std (median)
    assert min(relative_margins) > 0.05  # weight draws are vetted on exactly these inputs
    assert 0.5 < statistics.mean(agreements) < 0.95
