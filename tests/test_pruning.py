"""Draft visual-token pruning: the pure selection functions and the adapters' pruned/scored prefills."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmspec.models import adapter_for
from vlmspec.pruning import (
    PruningConfig,
    attention_keep,
    keep_count,
    select_prompt_positions,
    uniform_keep,
)
from vlmspec.testing import FAMILIES, build_tiny_pair, make_image, make_video_frames

TOL = 1e-4
IMAGE_SIZE = (112, 112)  # 16 visual tokens for the Qwen families, so pruning keeps more than one


def _ids(x: torch.Tensor) -> list[int]:
    return x.tolist()


# ---- pure functions -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, ratio, expected",
    [
        (10, 0.8, 2),
        (5, 0.8, 1),  # (1 - 0.8) * 5 = 0.9999999999999998 in floats: still 1
        (16, 0.8, 3),  # 3.2 -> 3
        (8, 0.9, 1),  # 0.8 -> 1
        (3, 0.9, 1),  # 0.3 rounds to 0, but at least one token stays
        (5, 0.5, 3),  # 2.5: halves round up
        (7, 0.0, 7),
        (1, 0.99, 1),
        (0, 0.5, 0),
    ],
)
def test_keep_count(n, ratio, expected):
    assert keep_count(n, ratio) == expected


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.1, float("nan")])
def test_keep_count_rejects_bad_ratio(ratio):
    with pytest.raises(ValueError, match=repr(ratio).replace(".", r"\.")):
        keep_count(10, ratio)


def test_uniform_keep_is_evenly_spaced():
    assert _ids(uniform_keep(10, 2)) == [2, 7]  # centres of [0, 5) and [5, 10)
    assert _ids(uniform_keep(10, 5)) == [1, 3, 5, 7, 9]
    assert _ids(uniform_keep(7, 1)) == [3]
    assert _ids(uniform_keep(4, 4)) == [0, 1, 2, 3]
    assert uniform_keep(5, 0).numel() == 0
    for n in range(1, 30):
        for k in range(1, n + 1):
            picks = uniform_keep(n, k)
            gaps = picks.diff()
            assert picks.numel() == k and int(picks[0]) >= 0 and int(picks[-1]) < n
            assert bool((gaps >= n // k).all()) and bool((gaps <= -(-n // k)).all())  # floor/ceil of n / k
    with pytest.raises(ValueError, match="budget=6"):
        uniform_keep(5, 6)


def test_attention_keep_top_mass_then_even_fill():
    # Sum 1.0. Descending: token 1 (0.30), token 3 (0.25), token 7 (0.20), ... 0.30 < 0.4 <= 0.30 + 0.25, so the
    # top tokens are {1, 3}. The other 2 picks are evenly spaced over the remaining [0, 2, 4, 5, 6, 7]:
    # uniform_keep(6, 2) = [1, 4] -> tokens 2 and 6. Token 7 (third highest) is not kept: the mass rule stops.
    scores = torch.tensor([0.05, 0.30, 0.02, 0.25, 0.03, 0.05, 0.10, 0.20])
    assert _ids(attention_keep(scores, budget=4, mass=0.4)) == [1, 2, 3, 6]
    # The top tokens are capped by the budget.
    assert _ids(attention_keep(scores, budget=2, mass=0.9)) == [1, 3]
    # A small mass needs only the top token: [1] + uniform_keep(7, 2) = [1, 5] over [0, 2, 3, 4, 5, 6, 7].
    assert _ids(attention_keep(scores, budget=3, mass=0.1)) == [1, 2, 6]
    # mass 0 (or all-zero scores) is pure even spacing.
    assert _ids(attention_keep(scores, budget=3, mass=0.0)) == _ids(uniform_keep(8, 3))
    assert _ids(attention_keep(torch.zeros(8), budget=3)) == _ids(uniform_keep(8, 3))
    # Edges.
    assert _ids(attention_keep(scores, budget=8)) == list(range(8))
    assert attention_keep(scores, budget=0).numel() == 0


def test_attention_keep_ties_prefer_lower_index():
    # Equal scores: 2 tokens cover 40% of 5 (cumsum 1 < 2 <= 2); the stable sort takes tokens 0 and 1, then the
    # fill picks uniform_keep(3, 1) = [1] of the remaining [2, 3, 4] -> token 3.
    assert _ids(attention_keep(torch.ones(5), budget=3, mass=0.4)) == [0, 1, 3]


def test_attention_keep_rejects_bad_inputs():
    with pytest.raises(ValueError, match="non-negative"):
        attention_keep(torch.tensor([0.5, -0.1, 0.2]), budget=1)
    with pytest.raises(ValueError, match="budget=4"):
        attention_keep(torch.ones(3), budget=4)
    with pytest.raises(ValueError, match="1-D"):
        attention_keep(torch.ones(2, 3), budget=1)
    with pytest.raises(ValueError, match="1.5"):
        attention_keep(torch.ones(3), budget=1, mass=1.5)


def _layout(length: int = 20, image=range(2, 12), video=range(14, 19)) -> tuple[torch.Tensor, torch.Tensor]:
    visual = torch.zeros(length, dtype=torch.bool)
    is_video = torch.zeros(length, dtype=torch.bool)
    visual[list(image)] = True
    visual[list(video)] = True
    is_video[list(video)] = True
    return visual, is_video


def test_select_prompt_positions_keeps_text_and_per_modality_budgets():
    visual, is_video = _layout()  # 10 image tokens at 2..11, 5 video tokens at 14..18
    text = (~visual).nonzero().flatten()
    keep = select_prompt_positions(
        visual, is_video, None, "uniform", image_ratio=0.8, video_ratio=0.6, mass=0.4
    )
    assert bool((keep.diff() > 0).all())
    assert set(_ids(text)) <= set(_ids(keep))
    kept_image = [p for p in _ids(keep) if visual[p] and not is_video[p]]
    kept_video = [p for p in _ids(keep) if is_video[p]]
    assert kept_image == [2 + i for i in _ids(uniform_keep(10, 2))]  # keep_count(10, 0.8) = 2
    assert kept_video == [14 + i for i in _ids(uniform_keep(5, 2))]  # keep_count(5, 0.6) = 2

    # Attention: the scores are per visual token, image tokens first here (visual-position order).
    scores = torch.full((15,), 0.01)
    scores[7] = 1.0  # image token at position 9
    scores[10 + 4] = 1.0  # video token at position 18
    keep = select_prompt_positions(visual, is_video, scores, "attention", 0.8, 0.6, 0.4)
    assert 9 in _ids(keep) and 18 in _ids(keep)
    assert len(keep) == text.numel() + 2 + 2
    # Ratios 0 keep everything (no scores needed).
    everything = select_prompt_positions(visual, is_video, None, "attention", 0.0, 0.0, 0.4)
    assert _ids(everything) == list(range(20))


def test_select_prompt_positions_errors():
    visual, is_video = _layout()
    with pytest.raises(ValueError, match="needs scores"):
        select_prompt_positions(visual, is_video, None, "attention", 0.8, 0.9, 0.4)
    with pytest.raises(ValueError, match=r"video_ratio.*1\.2"):
        select_prompt_positions(visual, is_video, None, "uniform", 0.8, 1.2, 0.4)
    with pytest.raises(ValueError, match=r"num_visual\] = \[15\]"):
        select_prompt_positions(visual, is_video, torch.ones(3), "attention", 0.8, 0.9, 0.4)
    with pytest.raises(ValueError, match="'topk'"):
        select_prompt_positions(visual, is_video, None, "topk", 0.8, 0.9, 0.4)


def test_pruning_config():
    config = PruningConfig()
    assert (config.method, config.image_ratio, config.video_ratio) == ("attention", 0.8, 0.9)
    assert config.mass == 0.4
    assert config.needs_scores and config.enabled
    assert not PruningConfig(method="uniform").needs_scores
    assert not PruningConfig(image_ratio=0.0, video_ratio=0.0).needs_scores
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.image_ratio = 0.5  # type: ignore[misc]
    for field, value in [("image_ratio", 1.0), ("video_ratio", -0.5), ("mass", 2.0), ("method", "random")]:
        with pytest.raises(ValueError, match=rf"PruningConfig\.{field}.*{value!r}"):
            PruningConfig(**{field: value})

    from vlmspec.models import PromptLayout

    visual, is_video = _layout()
    layout = PromptLayout(visual=visual, is_video=is_video)
    disabled = PruningConfig.disabled()
    assert not disabled.enabled and not disabled.needs_scores
    assert _ids(disabled.select(layout)) == list(range(20))
    uniform = PruningConfig(method="uniform", image_ratio=0.8, video_ratio=0.6, min_keep=0)
    assert _ids(uniform.select(layout)) == _ids(
        select_prompt_positions(visual, is_video, None, "uniform", 0.8, 0.6, 0.4)
    )
    # The default floor keeps every token of this prompt's small modalities: pruning them would not pay.
    assert _ids(PruningConfig().select(layout, torch.rand(int(visual.sum())))) == list(range(20))


def test_min_keep_floors_each_modality_and_is_validated():
    visual, is_video = _layout()
    images, videos = int((visual & ~is_video).sum()), int(is_video.sum())
    for min_keep in (0, 2, 3, 100):
        keep = select_prompt_positions(visual, is_video, None, "uniform", 0.8, 0.9, 0.4, min_keep)
        kept_images = int((visual & ~is_video)[keep].sum())
        kept_videos = int(is_video[keep].sum())
        assert kept_images == max(keep_count(images, 0.8), min(min_keep, images))
        assert kept_videos == max(keep_count(videos, 0.9), min(min_keep, videos))
    from vlmspec.models import PromptLayout

    layout = PromptLayout(visual=visual, is_video=is_video)  # 10 image and 5 video tokens
    assert not PruningConfig().prunes(layout) and PruningConfig(min_keep=6).prunes(layout)
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ValueError, match=rf"PruningConfig\.min_keep.*{bad!r}.*use 0"):
            PruningConfig(min_keep=bad)


# ---- adapters -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_root_dir(tiny_root) -> Path:
    return tiny_root


@pytest.fixture(scope="module")
def loaded(tiny_root_dir):
    """family -> (target model, draft model, processor), fp32 on the CPU, loaded once."""
    cache = {}

    def get(family: str):
        if family not in cache:
            pair = build_tiny_pair(family, root=tiny_root_dir)
            target = AutoModelForImageTextToText.from_pretrained(pair.target, dtype=torch.float32).eval()
            draft = AutoModelForImageTextToText.from_pretrained(pair.draft, dtype=torch.float32).eval()
            cache[family] = (target, draft, AutoProcessor.from_pretrained(pair.target))
        return cache[family]

    return get


def _inputs(processor, kind: str) -> dict[str, torch.Tensor]:
    """Processor inputs for one chat turn with an image, a video or both, as the pipeline builds them."""
    content, kwargs = [], {}
    if kind in ("image", "both"):
        content.append({"type": "image"})
        kwargs["images"] = [make_image(0, size=IMAGE_SIZE)]
    if kind in ("video", "both"):
        content.append({"type": "video"})
        kwargs["videos"] = [make_video_frames(0)]
        kwargs["do_sample_frames"] = False
    content.append({"type": "text", "text": "Describe this image."})
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(processor(text=[text], return_tensors="pt", **kwargs))


def _max_cache_diff(a, b) -> float:
    assert a.get_seq_length() == b.get_seq_length()
    return max(
        max(float((la.keys - lb.keys).abs().max()), float((la.values - lb.values).abs().max()))
        for la, lb in zip(a.layers, b.layers, strict=True)
    )


CASES = [(family, kind) for family in FAMILIES for kind in ("image", "video")]


@pytest.mark.parametrize("family, kind", CASES)
def test_pruned_draft_prefill_holds_kept_visual_tokens(loaded, family, kind):
    target_model, draft_model, processor = loaded(family)
    target, draft = adapter_for(target_model), adapter_for(draft_model)
    inputs = _inputs(processor, kind)
    layout = target.prompt_layout(inputs)
    length, num_visual = inputs["input_ids"].shape[1], layout.num_visual
    num_video = int(layout.is_video.sum())
    assert num_visual > 0

    scored = target.prefill(inputs, score_visual=True)
    assert scored.state.length == length and scored.state.visual_tokens == num_visual
    assert scored.visual_scores.shape == (num_visual,)

    config = PruningConfig(min_keep=0)  # attention, image 0.8, video 0.9, as given
    keep = config.select(layout, scored.visual_scores)
    kept_visual = keep_count(num_visual - num_video, 0.8) + keep_count(num_video, 0.9)
    ratio = 0.9 if num_video else 0.8  # InternVL writes a video's frames as images: the image ratio
    # (1 - ratio) of the visual tokens, within rounding.
    assert abs(kept_visual - (1 - ratio) * num_visual) <= 1
    pruned = draft.prefill(inputs, keep=keep)
    assert pruned.state.visual_tokens == kept_visual
    assert pruned.state.length == (length - num_visual) + kept_visual
    assert pruned.logits.shape == scored.logits.shape
    # The decode offset is the full prompt's: generated tokens continue from the full logical length.
    assert int(pruned.state.rope_delta) == int(target.prompt_rope(inputs)[1])

    # Keeping every position is the plain prefill.
    plain = draft.prefill(inputs)
    everything = draft.prefill(inputs, keep=torch.arange(length))
    assert everything.state.length == length and everything.state.visual_tokens == num_visual
    assert float((everything.logits - plain.logits).abs().max()) <= TOL
    assert _max_cache_diff(everything.state.cache, plain.state.cache) <= TOL


@pytest.mark.parametrize("family, kind", CASES + [("qwen3_vl", "both")])
def test_split_scored_prefill_equals_plain_prefill(loaded, family, kind):
    target_model, _, processor = loaded(family)
    target = adapter_for(target_model)
    inputs = _inputs(processor, kind)
    decoder = target_model.get_decoder()
    implementation = decoder.config._attn_implementation

    plain = target.prefill(inputs)
    scored = target.prefill(inputs, score_visual=True)
    # The scored prefill is the model's own forward (scores come from a side pass): bit-identical.
    assert torch.equal(scored.logits, plain.logits)
    assert _max_cache_diff(scored.state.cache, plain.state.cache) == 0
    scores = scored.visual_scores
    assert scores.dtype == torch.float32 and bool((scores > 0).all()) and float(scores.sum()) <= 1.0 + 1e-5
    # The model is left as it was: same attention implementation, no hooks.
    assert decoder.config._attn_implementation == implementation
    assert all(not layer.self_attn._forward_hooks for layer in decoder.layers)


@pytest.mark.parametrize("family", ["qwen3_vl", "llava_onevision"])
def test_scored_prefill_without_text_after_visual_tokens(loaded, family):
    """The prompt ends on a visual token: no text scores them; selection falls back to uniform."""
    target_model, _, processor = loaded(family)
    target = adapter_for(target_model)
    inputs = _inputs(processor, "image")
    last = int(target.prompt_layout(inputs).visual.nonzero().max())
    cut = {
        k: (v[:, : last + 1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v)
        for k, v in inputs.items()
    }
    plain = target.prefill(cut)
    scored = target.prefill(cut, score_visual=True)
    assert torch.equal(scored.logits, plain.logits)
    assert scored.visual_scores is None
    layout = target.prompt_layout(cut)
    literal = PruningConfig(min_keep=0)
    assert torch.equal(
        literal.select(layout, None), PruningConfig(method="uniform", min_keep=0).select(layout)
    )


def test_prefill_rejects_bad_keep(loaded):
    target_model, _, processor = loaded("qwen2_vl")
    adapter = adapter_for(target_model)
    inputs = _inputs(processor, "image")
    length = inputs["input_ids"].shape[1]
    for bad in (torch.tensor([3, 2, 5]), torch.tensor([0, length]), torch.zeros(0, dtype=torch.long)):
        with pytest.raises(ValueError, match="keep"):
            adapter.prefill(inputs, keep=bad)


PLANTED = 5  # visual token (among the image's 16) that the text is made to attend to


def _plant_feature(model: torch.nn.Module, dim: int):
    """Forward hook on the vision tower: the PLANTED image token's merged feature becomes a one-hot along ``dim``."""

    def hook(module, args, output):
        features = output.pooler_output.clone()  # [num_visual, D] merged visual features
        features[PLANTED] = 0.0
        features[PLANTED, dim] = 10.0
        output.pooler_output = features
        return output

    return model.model.visual.register_forward_hook(hook)


def test_attention_pruning_keeps_a_strongly_attended_visual_token(tiny_root_dir):
    """A planted visual token that every text query attends to survives attention pruning.

    How the plant works (Qwen2-VL target, layer 0, no q/k norms): in every head, the rotary pair with the lowest
    frequency (head dim ``d/2 - 1``; it rotates by ~1e-3 rad per position, so it barely depends on position)
    is rewired so that the key reads only hidden dimension ``dim`` (``k = s * x_hat[dim]``) and the query is a
    constant ``s`` (bias only). The planted image token's feature is the one-hot vector along ``dim``, so after
    the layer's RMSNorm ``x_hat[dim] = sqrt(D) = 8`` for it, against ``|x_hat[dim]| ~ 1`` for other tokens: its
    layer-0 logit is ``s^2 * 8 / sqrt(d) = 32`` against at most ~10 for the others, and every query puts most of
    all its layer-0 attention on it. The scores (mean over layers) then rank it first by a wide margin.
    """
    pair = build_tiny_pair("qwen2_vl", root=tiny_root_dir)
    model = AutoModelForImageTextToText.from_pretrained(pair.target, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(pair.target)
    decoder = model.get_decoder()
    norm = decoder.layers[0].input_layernorm.weight.detach()
    dim = int(norm.abs().argmax())
    attn = decoder.layers[0].self_attn
    text_config = model.config.get_text_config()
    head_dim, strength = attn.head_dim, 4.0
    q_rows = torch.arange(text_config.num_attention_heads) * head_dim + head_dim // 2 - 1
    k_rows = torch.arange(text_config.num_key_value_heads) * head_dim + head_dim // 2 - 1
    with torch.no_grad():
        attn.q_proj.weight[q_rows] = 0.0
        attn.q_proj.bias[q_rows] = strength
        attn.k_proj.weight[k_rows] = 0.0
        attn.k_proj.weight[k_rows, dim] = strength * float(norm[dim].sign())
        attn.k_proj.bias[k_rows] = 0.0

    adapter = adapter_for(model)
    inputs = _inputs(processor, "image")
    layout = adapter.prompt_layout(inputs)
    assert layout.num_visual == 16
    handle = _plant_feature(model, dim)
    try:
        scores = adapter.prefill(inputs, score_visual=True).visual_scores
    finally:
        handle.remove()
    others = torch.cat([scores[:PLANTED], scores[PLANTED + 1 :]])
    assert int(scores.argmax()) == PLANTED and float(scores[PLANTED]) > 3 * float(others.max())

    visual_pos = layout.visual.nonzero().flatten()
    planted_pos = int(visual_pos[PLANTED])
    uniform = PruningConfig(method="uniform", min_keep=0).select(layout)
    assert planted_pos not in _ids(uniform)  # even spacing alone would drop it
    keep = PruningConfig(method="attention", min_keep=0).select(layout, scores)
    assert planted_pos in _ids(keep)
    assert int(layout.visual[keep].sum()) == keep_count(16, 0.8)


class _ProbeHolder:
    """A forward hook for a decoder's first layer: holds thread ``probe`` inside its eager-attention probe until
    ``release`` is set (``probing`` says it is there), and records the attention implementation thread ``other``
    runs under (``seen``; ``ran`` set when it runs)."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        import threading

        self.decoder, self.probe, self.other = decoder, None, None
        self.probing, self.release, self.ran = threading.Event(), threading.Event(), threading.Event()
        self.seen: list[str] = []

    def hook(self, module, args, output) -> None:
        import threading

        current = threading.current_thread()
        if self.decoder.config._attn_implementation == "eager" and current is self.probe:
            self.probing.set()
            self.release.wait(10)  # hold the probe open
        elif current is self.other:
            self.seen.append(self.decoder.config._attn_implementation)
            self.ran.set()


def test_a_forward_in_another_thread_waits_for_the_pruning_probe(tiny_pairs):
    """The probe switches the target's decoder to eager attention for its side pass: a forward another thread runs
    meanwhile (a second request on the same pipeline) waits for it, instead of running under the switch (eager with
    the mask its sdpa call built is not causal: wrong tokens, silently)."""
    import threading
    import time

    from vlmspec import VLMSpecPipeline

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    decoder = pipe.target.get_decoder()
    usual = decoder.config._attn_implementation
    assert usual != "eager"
    hold = _ProbeHolder(decoder)
    handle = decoder.layers[0].register_forward_hook(hold.hook)
    image = make_image(0)
    pruned = hold.probe = threading.Thread(
        target=lambda: pipe(image, "Describe.", prune_ratio=0.5, max_new_tokens=2)
    )
    plain = hold.other = threading.Thread(target=lambda: pipe(image, "Describe.", max_new_tokens=2))
    probing, release, seen = hold.probing, hold.release, hold.seen
    try:
        pruned.start()
        assert probing.wait(30)
        plain.start()
        time.sleep(0.3)
        assert seen == []  # not run while the probe holds the model
        release.set()
        pruned.join(30)
        plain.join(30)
    finally:
        release.set()
        handle.remove()
    assert seen and set(seen) == {usual}
    assert decoder.config._attn_implementation == usual


def test_a_pruned_draft_prefill_waits_for_the_pruning_probe_of_a_shared_model(tiny_pairs):
    """Two pipelines share a model: one's target, the other's draft. The pruned draft prefill of the second waits
    for the first's probe on that model, instead of running under its switch to eager attention and its hooks (its
    attention was added to the probe's scores: the first call pruned by another prompt's attention)."""
    import threading

    from vlmspec import VLMSpecPipeline

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    swapped = VLMSpecPipeline(pipe.draft, pipe.target, pipe.processor, policy="chain")  # pipe's target drafts
    decoder, other = pipe.target.get_decoder(), pipe.draft.get_decoder()
    usual = decoder.config._attn_implementation
    hold, scored = _ProbeHolder(decoder), threading.Event()
    probing, release, ran, seen = hold.probing, hold.release, hold.ran, hold.seen

    def scored_hook(module, args, output):  # the swapped pipeline's own probe: its draft prefill comes next
        if other.config._attn_implementation == "eager" and threading.current_thread() is pruned:
            scored.set()

    handles = [
        decoder.layers[0].register_forward_hook(hold.hook),
        other.layers[0].register_forward_hook(scored_hook),
    ]
    image = make_image(0)
    probe = hold.probe = threading.Thread(
        target=lambda: pipe(image, "Describe.", prune_ratio=0.5, max_new_tokens=2)
    )
    pruned = hold.other = threading.Thread(
        target=lambda: swapped(image, "Describe.", prune_ratio=0.5, max_new_tokens=2)
    )
    try:
        probe.start()
        assert probing.wait(30)
        pruned.start()
        assert scored.wait(30)
        assert not ran.wait(1.0) and seen == []  # not run while the probe holds the model
        release.set()
        probe.join(30)
        pruned.join(30)
    finally:
        release.set()
        for handle in handles:
            handle.remove()
    assert seen and set(seen) == {usual}
    assert decoder.config._attn_implementation == usual


def test_qwen3_s_deepstack_rows_follow_the_kept_visual_positions():
    """Positions 1-3 are visual (deepstack rows 0-2); keeping positions 0, 2, 4 keeps visual position 2 only, so
    its deepstack row is row 1, not the first row."""
    from vlmspec.models.qwen import QwenVLAdapter

    prompt = {
        "inputs_embeds": torch.zeros(1, 5, 2),
        "visual_pos_masks": torch.tensor([[0, 1, 1, 1, 0]]).bool(),
        "deepstack_visual_embeds": [torch.arange(3.0)[:, None]],
    }
    selected = QwenVLAdapter(None).select_prompt(prompt, torch.tensor([0, 2, 4]))
    assert selected["visual_pos_masks"].tolist() == [[False, True, False]]
    assert selected["deepstack_visual_embeds"][0].tolist() == [[1.0]]
