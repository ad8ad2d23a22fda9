"""Loading, components, statistics, stop conditions and clear errors of VLMSpecPipeline."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import PROMPTS
from transformers import AutoTokenizer

from vlmspec import SpecStats, VLMSpecPipeline, get_policy, hf_compat
from vlmspec.cli import main as cli_main
from vlmspec.errors import InvalidInputError
from vlmspec.named_pairs import resolve_pair
from vlmspec.policies import C2TClassifier
from vlmspec.pruning import PruningConfig
from vlmspec.testing import FAMILIES, make_image, make_video_frames, write_video


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, torch_dtype=torch.float32)


def test_from_pretrained_loads_saved_folders_with_sage_default(pipe, tiny_pairs):
    assert pipe.policy.name == "sage"
    assert pipe.target.config.model_type == pipe.draft.config.model_type == "qwen2_vl"
    assert sum(p.numel() for p in pipe.draft.parameters()) < sum(p.numel() for p in pipe.target.parameters())


def test_policy_is_a_swappable_component(pipe):
    pipe.policy = get_policy("chain", gamma=4)
    out = pipe(make_image(0), PROMPTS[0], max_new_tokens=24)
    assert out.stats.policy == "chain" and max(out.stats.tree_sizes) <= 4
    with pytest.raises(TypeError, match="TreePolicy"):
        pipe.policy = 42
    # A policy whose budget the machine decides is fitted as a copy: the user's object (which may serve another
    # pipeline) keeps its configuration.
    sage = get_policy("sage")
    pipe.policy = sage
    fitted = pipe.hardware_costs().node_budget(pipe.budget_factor)
    assert pipe.policy.config.n_max == fitted and sage.config == get_policy("sage").config
    pipe.policy = "sage"


def test_stats_fields_and_trace(pipe):
    pipe.policy = "sage"
    out = pipe(make_image(0), PROMPTS[0], max_new_tokens=40)
    s = out.stats
    assert s.new_tokens == len(out.token_ids) == 40
    assert s.steps == len(s.tree_sizes) == len(s.trace)
    assert s.mean_accepted == pytest.approx(s.accepted_tokens / s.steps)
    assert s.tokens_per_step == pytest.approx((s.new_tokens - 1) / s.steps)
    assert s.tokens_per_second > 0 and s.prefill_seconds > 0 and s.verify_seconds > 0 and s.draft_seconds > 0
    assert s.target_visual_tokens > 0 and s.draft_visual_tokens > 0
    for entry in s.trace:
        assert {"depth", "width", "tree_size", "accepted", "max_depth"} <= set(entry)
        assert (entry["depth"] > 0) == (entry["tree_size"] > 0) == (entry["width"] > 0)
    assert sum(t["accepted"] for t in s.trace) == s.accepted_tokens
    as_dict = s.to_dict()
    assert json.loads(json.dumps(as_dict))["new_tokens"] == 40 and as_dict["lossless"] is True


def test_stop_strings_and_eos_match_generate(pipe):
    pipe.policy = "static"
    inputs = pipe.prepare_inputs(make_image(0), PROMPTS[3])
    free = pipe(make_image(0), PROMPTS[3], max_new_tokens=40)
    # A stop string taken from the middle of the free-running text.
    text = pipe.tokenizer.decode(free.token_ids[10:14])
    stop = text.strip()[:3] or text[:3]
    ref = pipe.target.generate(
        **inputs, do_sample=False, max_new_tokens=40, stop_strings=[stop], tokenizer=pipe.tokenizer
    )[0, inputs["input_ids"].shape[1] :].tolist()
    out = pipe(make_image(0), PROMPTS[3], max_new_tokens=40, stop_strings=[stop])
    assert out.token_ids == ref and len(ref) < 40
    assert out.stats.mean_accepted <= out.stats.tokens_per_step  # tokens cut by the stop are not counted
    # A stop string that begins in the prompt and ends in the first reply token: generate() decodes the whole
    # sequence, so it stops there.
    prompt_tail = pipe.tokenizer.decode(inputs["input_ids"][0, -1:])
    first_text = pipe.tokenizer.decode(free.token_ids[:1])
    across = prompt_tail[-2:] + first_text[:1]
    ref = pipe.target.generate(
        **inputs, do_sample=False, max_new_tokens=40, stop_strings=across, tokenizer=pipe.tokenizer
    )[0, inputs["input_ids"].shape[1] :].tolist()
    assert ref == free.token_ids[:1], (across, ref)
    assert pipe(make_image(0), PROMPTS[3], max_new_tokens=40, stop_strings=across).token_ids == ref
    # EOS: make the first generated token an EOS id; generation stops right after it, EOS included.
    first = free.token_ids[0]
    eos_before = pipe.target.generation_config.eos_token_id
    try:
        pipe.target.generation_config.eos_token_id = first
        out = pipe(make_image(0), PROMPTS[3], max_new_tokens=40)
        assert out.token_ids == [first]
    finally:
        pipe.target.generation_config.eos_token_id = eos_before


def test_a_stop_string_split_over_byte_tokens_stops_where_generate_stops(pipe):
    from transformers.generation.stopping_criteria import StopStringCriteria

    from vlmspec.stopping import StopCriteria

    ids = pipe.tokenizer("test \U0001f600 done", add_special_tokens=False)[
        "input_ids"
    ]  # the emoji: byte tokens
    assert any("\ufffd" in pipe.tokenizer.decode([i]) for i in ids)
    stops = []
    for cut in range(1, len(ids)):  # every split between prompt and reply
        prompt, reply = ids[:cut], ids[cut:]
        ours = StopCriteria(100, stop_strings="\U0001f600", tokenizer=pipe.tokenizer).after_prompt(
            torch.tensor(prompt)
        )
        theirs = StopStringCriteria(pipe.tokenizer, ["\U0001f600"])
        at_ours = next((i for i in range(1, len(reply) + 1) if ours.update(reply[:i])), None)
        at_theirs = next(
            (i for i in range(1, len(reply) + 1) if theirs(torch.tensor([prompt + reply[:i]]), None)[0]), None
        )
        assert at_ours == at_theirs, (cut, at_ours, at_theirs)
        stops.append(at_ours)
    assert any(stops)


def test_video_file_input(pipe, tmp_path):
    path = write_video(tmp_path / "clip.mp4", make_video_frames(0, num_frames=4))
    out = pipe(None, "Describe this video.", video=path, max_new_tokens=16, num_frames=4)
    assert out.stats.new_tokens == 16 and out.stats.target_visual_tokens > 0


def _processor_inputs(pipe, images, prompt):
    """Processor outputs built outside the pipeline, as a transformers user builds them."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = pipe.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return pipe.processor(text=[text], images=[images], return_tensors="pt")


def test_generate_is_a_drop_in_for_the_targets_generate(pipe):
    pipe.policy = "sage"
    inputs = _processor_inputs(pipe, [make_image(1), make_image(2)], PROMPTS[1])
    ref = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=20)
    ids = pipe.generate(**inputs, max_new_tokens=20)
    assert ids.shape == ref.shape and torch.equal(ids, ref)
    # decoded in inference mode, returned as generate() returns it: an ordinary tensor code may write into
    assert not ids.is_inference() and not ref.is_inference()
    ids[0, 0] = ids[0, 0]
    sampled = [pipe.generate(**inputs, max_new_tokens=12, do_sample=True, seed=7) for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1]) and torch.equal(
        sampled[0][:, : inputs["input_ids"].shape[1]], inputs["input_ids"]
    )
    # What code written for generate() passes along: an EOS of its own, use_cache, one beam and one sequence.
    stop_at = ref[0, inputs["input_ids"].shape[1] + 2].item()
    early = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=20, eos_token_id=stop_at)
    kept = pipe.generate(**inputs, max_new_tokens=20, eos_token_id=stop_at, use_cache=True, num_beams=1)
    assert torch.equal(kept, early) and kept.shape[1] <= inputs["input_ids"].shape[1] + 3
    config = pipe.target.generation_config  # generate()'s fallbacks are the target's generation config
    saved = (config.do_sample, config.max_new_tokens)
    try:
        config.do_sample, config.max_new_tokens = True, 9
        assert torch.equal(
            pipe.generate(**inputs, seed=3), pipe.generate(**inputs, do_sample=True, seed=3, max_new_tokens=9)
        )
    finally:
        config.do_sample, config.max_new_tokens = saved
    # The same inputs as batch requests: each row is that prompt's own reply.
    other = _processor_inputs(pipe, [make_image(3)], PROMPTS[2])
    outs = pipe.batch([{"inputs": inputs, "max_new_tokens": 20}, {"inputs": other, "max_new_tokens": 20}], 2)
    assert outs[0].token_ids == ids[0, inputs["input_ids"].shape[1] :].tolist()
    assert outs[1].token_ids == pipe.reference_generate(dict(other), 20)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_on_a_padded_batch_gives_each_prompt_its_own_generate(tiny_pairs, family):
    """A batch of prompts as a processor pads them (an image, text only, two images, a video): each row's new
    tokens are that prompt's own greedy generate() at batch 1; the output is laid out as generate()'s."""
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(0)], None),
        ([{"type": "text", "text": "Hello"}], [], None),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[1]}], [make_image(1), make_image(2)], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[2]}], [], make_video_frames(0)),
    ]  # fmt: skip
    template = pipe.processor.apply_chat_template
    texts = [
        template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c, _, _ in prompts
    ]
    batch = pipe.processor(
        text=texts, images=[images for _, images, _ in prompts], videos=[v for _, _, v in prompts if v is not None],
        padding=True, return_tensors="pt",
    )  # fmt: skip
    ids = pipe.generate(**batch, max_new_tokens=12, batch_size=3)
    length = batch["input_ids"].shape[1]
    assert torch.equal(ids[:, :length], batch["input_ids"])
    for b, (_content, images, video) in enumerate(prompts):
        alone = pipe.processor(
            text=[texts[b]], images=[images] if images else None, videos=[video] if video is not None else None,
            return_tensors="pt",
        )  # fmt: skip
        row = pipe.target_adapter.split_rows(dict(batch))[b]
        assert set(row) == set(alone) and all(_same_input(row[k], alone[k]) for k in alone), (family, b)
        expected = pipe.reference_generate(dict(alone), 12)
        assert ids[b, length : length + len(expected)].tolist() == expected, (family, b)
        assert (ids[b, length + len(expected) :] == hf_compat.pad_token_id(pipe.target)).all()
    assert ids.shape[1] == length + max(
        len(pipe.reference_generate(dict(r), 12)) for r in pipe.target_adapter.split_rows(dict(batch))
    )


def test_generate_takes_either_padding_side_repeated_rows_and_refuses_flat_image_lists(tiny_pairs, pipe):
    texts = [
        pipe.processor.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [{"type": "text", "text": "Hi"}])
    ]
    alone = [pipe.reference_generate(dict(_processor_inputs(pipe, [make_image(0)], PROMPTS[0])), 10)]
    alone.append(pipe.reference_generate(dict(pipe.processor(text=[texts[1]], return_tensors="pt")), 10))
    tokenizer = pipe.processor.tokenizer
    side = tokenizer.padding_side
    try:
        tokenizer.padding_side = "right"
        right = pipe.processor(text=texts, images=[[make_image(0)], []], padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    ids = pipe.generate(**right, max_new_tokens=10)
    length = right["input_ids"].shape[1]
    assert [ids[b, length : length + len(alone[b])].tolist() for b in range(2)] == alone
    # One prompt padded to a fixed length: its own generate() all the same.
    one = pipe.processor(text=texts[1:], padding="max_length", max_length=length + 6, return_tensors="pt")
    assert pipe.generate(**one, max_new_tokens=10)[0, length + 6 :].tolist() == alone[1]
    # The same prompt three times, sampled: each row its own draw (seed + b), the same draws on a rerun.
    three = {k: v.repeat(3, 1) for k, v in pipe.processor(text=texts[1:], return_tensors="pt").items()}
    drawn = [pipe.generate(**three, do_sample=True, seed=11, max_new_tokens=8) for _ in range(2)]
    assert torch.equal(drawn[0], drawn[1]) and len({tuple(row.tolist()) for row in drawn[0]}) == 3
    # LLaVA-OneVision: a flat list of images cannot be told apart per prompt.
    llava = VLMSpecPipeline.from_pretrained(
        tiny_pairs["llava_onevision"].target, tiny_pairs["llava_onevision"].draft
    )
    content = [{"type": "image"}, {"type": "text", "text": "?"}]
    text = llava.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    flat = llava.processor(
        text=[text, text.replace("<image>", "<image><image>", 1)],
        images=[make_image(0), make_image(1), make_image(2)],
        padding=True,
        return_tensors="pt",
    )
    with pytest.raises(
        ValueError,
        match=r"batch_num_images has 3 entries for 2 prompts with images; .*images=\[\[a\], \[b, c\]\]",
    ):
        llava.generate(**flat, max_new_tokens=4)


def _same_input(split: torch.Tensor, alone: torch.Tensor) -> bool:
    """A row's input as split from a batch equals the prompt's own (LLaVA-OneVision pads every image's anyres
    tiles to the batch's most: the extra tiles are zeros the model drops by ``image_sizes``)."""
    if split.shape != alone.shape and split.dim() == 5:
        return torch.equal(split[:, : alone.shape[1]], alone) and not split[:, alone.shape[1] :].any()
    return torch.equal(split, alone)


def test_generate_options_are_the_calls_generation_options():
    parameters = inspect.signature(VLMSpecPipeline.__call__).parameters.values()
    taken = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD}  # **unknown: refused by name
    inputs = {
        "self",
        "image",
        "prompt",
        "video",
        "messages",
        "inputs",
        "num_frames",
        "tools",
        "chat_template_kwargs",
        "mm_processor_kwargs",
    }
    returned = {"output_scores"}  # what pipe.generate returns (its output_scores/output_logits settings)
    openai = {
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "structured_outputs",
    }  # OpenAI's and vLLM's, which generate() does not take
    assert set(hf_compat.GENERATE_OPTIONS) == taken - inputs - returned - openai


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_takes_every_processor_output_and_refuses_what_the_model_does_not_use(tiny_pairs, family):
    """What generate() passes on to the model (transformers' own check of unused model_kwargs) covers every
    processor output of each family, images and videos; another tensor is refused by name."""
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", gamma=2)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": PROMPTS[0]}]
    text = pipe.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    outputs = pipe.processor(
        text=[text], images=[make_image(0)], videos=[make_video_frames(0)], return_tensors="pt"
    )
    taken = hf_compat.model_inputs(pipe.target)
    assert set(outputs) <= taken, (family, set(outputs) - taken)
    _, tensors = hf_compat.split_generate_kwargs(dict(outputs), hf_compat.GENERATE_OPTIONS, taken)
    assert set(tensors) == set(outputs)
    with pytest.raises(TypeError, match=r"does not take foo: it takes processor outputs"):
        hf_compat.split_generate_kwargs({**outputs, "foo": torch.ones(1)}, hf_compat.GENERATE_OPTIONS, taken)


def test_generate_refuses_what_it_cannot_do_naming_it(pipe):
    inputs = _processor_inputs(pipe, [make_image(1)], PROMPTS[1])
    with pytest.raises(TypeError, match=r"does not take assistant_model, negative_prompt_ids: it takes"):
        pipe.generate(**inputs, negative_prompt_ids=inputs["input_ids"], assistant_model=pipe.draft)
    plain = pipe.generate(**inputs, max_new_tokens=4)
    assert torch.equal(pipe.generate(**inputs, max_new_tokens=4, cache_implementation="static"), plain)
    with pytest.raises(
        TypeError, match=r"num_beams=4\): vlmspec decodes greedily or by sampling, not by beam"
    ):
        pipe.generate(**inputs, num_beams=4)
    with pytest.raises(TypeError, match=r"eos_token_id='x' must be a token id"):
        pipe.generate(**inputs, eos_token_id="x")
    two = {k: torch.cat([v, v]) if k in ("input_ids", "attention_mask") else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match=r"image_grid_thw does not match the placeholder tokens of row 1"):
        pipe.generate(**two)  # two prompts, one image's pixels
    with pytest.raises(ValueError, match=r"input_ids'\] has shape \(2, \d+\); give one prompt.*pipe\.batch"):
        pipe(inputs=two)
    padded = {**inputs, "attention_mask": inputs["attention_mask"].clone()}
    padded["attention_mask"][0, 0] = 0
    with pytest.raises(ValueError, match="masks some prompt tokens"):
        pipe(inputs=padded)
    with pytest.raises(ValueError, match="give either inputs or messages or image/prompt/video"):
        pipe(make_image(1), "Hi", inputs=inputs)
    with pytest.raises(TypeError, match="inputs must be a processor's outputs"):
        pipe(inputs={"pixel_values": inputs["pixel_values"]})


def test_save_pretrained_loads_back_with_the_settings_set_on_it(pipe, tmp_path, capsys):
    """The pair, the policy with the options the user set (not the machine-fitted ones) and the pruning."""
    pipe.policy = get_policy(
        "sage", w_max=4, d_min=9
    )  # n_max, d_max and the node and level costs: the machine's
    pipe.pruning = PruningConfig(
        image_ratio=np.float64(0.5), min_keep=0
    )  # numpy numbers are saved as numbers
    try:
        folder = pipe.save_pretrained(tmp_path / "saved")
        settings = yaml.safe_load((folder / "vlmspec_pipeline.yaml").read_text())
        # As set, not as fitted (fitting the depth lowers d_min with d_max on a machine that affords less).
        assert settings["policy"] == "sage" and settings["policy_options"] == {"d_min": 9, "w_max": 4}
        assert settings["pruning"]["image_ratio"] == 0.5
        loaded = VLMSpecPipeline.from_pretrained(folder)
        assert loaded.policy.name == "sage" and loaded.policy.config.w_max == 4
        assert (
            loaded.policy.free_hardware_options()
            == pipe.policy.free_hardware_options()
            == ("n_max", "d_max", "node_cost", "level_cost")
        )
        assert loaded.pruning == pipe.pruning
        image, prompt = make_image(4), PROMPTS[2]
        assert (
            loaded(image, prompt, max_new_tokens=16).token_ids
            == pipe(image, prompt, max_new_tokens=16).token_ids
        )
        # Arguments given on loading win; options without a policy go on top of the saved ones.
        assert VLMSpecPipeline.from_pretrained(folder, policy="chain").policy.name == "chain"
        assert VLMSpecPipeline.from_pretrained(folder, w_min=3).policy.config.w_max == 4
        assert loaded.policy.requested == {"d_min": 9, "w_max": 4}
        assert "policy=sage" in _demo_output(cli_main, folder, capsys)  # the demo takes its settings too
        pipe.policy = "chain"
        assert "policy=chain" in _demo_output(cli_main, pipe.save_pretrained(tmp_path / "chain"), capsys)
        # Every entry point that names a target resolves the folder to its pair.
        resolved = resolve_pair(str(folder))
        assert (resolved.target, resolved.draft) == (str(folder / "target"), str(folder / "draft"))
        (tmp_path / "foreign").mkdir()
        (tmp_path / "foreign" / "notes.txt").write_text("mine")
        with pytest.raises(ValueError, match="is not empty and holds no saved pipeline"):
            pipe.save_pretrained(tmp_path / "foreign")
        (folder / "draft" / "edd_config.json").write_text("{}")  # left by an earlier save: replaced, not kept
        assert not (pipe.save_pretrained(folder) / "draft" / "edd_config.json").exists()
        (folder / "vlmspec_pipeline.yaml").write_text("policy: sage\npolicy_options: {w_max: many}\n")
        with pytest.raises(ValueError, match="w_max"):
            VLMSpecPipeline.from_pretrained(folder)
        (folder / "vlmspec_pipeline.yaml").write_text("policy: sage\nspeed: fast\n")
        with pytest.raises(
            ValueError, match=r"vlmspec_pipeline.yaml' must be a mapping with the keys policy"
        ):
            VLMSpecPipeline.from_pretrained(folder)
    finally:
        pipe.policy, pipe.pruning = "sage", PruningConfig()


def _demo_output(main, folder, capsys) -> str:
    assert main(["demo", "--target", str(folder), "--max-new-tokens", "8"]) == 0
    return capsys.readouterr().out


def test_saved_pipeline_keeps_a_copy_of_its_policys_files_and_loads_anywhere(pipe, tmp_path, monkeypatch):
    """C2T's own classifier, named relative to the working directory, is copied (with its JSON spec) into the
    folder and read back against it: with the original deleted and the folder moved, the loaded pipeline builds
    the same trees and samples the same tokens (sampled tokens depend on the tree, greedy ones would not)."""
    monkeypatch.chdir(tmp_path)
    _confident_classifier().save("my_c2t.safetensors")
    pipe.policy = get_policy("c2t", classifier="my_c2t.safetensors", max_depth=3)
    try:
        before = _sampled(pipe)
        folder = pipe.save_pretrained(tmp_path / "saved")
        settings = yaml.safe_load((folder / "vlmspec_pipeline.yaml").read_text())
        assert settings["policy_options"]["classifier"] == "policy_files/classifier/my_c2t.safetensors"
        for original in ("my_c2t.safetensors", "my_c2t.json"):
            Path(original).unlink()
        with pytest.raises(
            FileNotFoundError, match=r"classifier='my_c2t.safetensors' needs 'my_c2t.safetensors'"
        ):
            pipe.save_pretrained(tmp_path / "again")  # the policy's own file is gone: refused, naming it
        moved = Path(shutil.move(folder, tmp_path / "elsewhere"))
        monkeypatch.chdir(moved / "target")  # neither the saved folder nor the original's
        loaded = VLMSpecPipeline.from_pretrained(moved)
        assert (
            Path(loaded.policy.config.classifier)
            == moved / "policy_files" / "classifier" / "my_c2t.safetensors"
        )
        after = _sampled(loaded)
        assert after.token_ids == before.token_ids and after.stats.tree_sizes == before.stats.tree_sizes
        assert max(before.stats.tree_sizes) == 45  # the classifier passes every candidate: 3 layers of top-15
        loaded.save_pretrained(moved)  # into the folder its files come from: they are kept
        assert (moved / "policy_files" / "classifier" / "my_c2t.json").is_file()
    finally:
        pipe.policy = "sage"


def _confident_classifier() -> C2TClassifier:
    """A C2T classifier that trusts every candidate (the shipped default passes far fewer on the tiny pair)."""
    classifier = C2TClassifier()
    torch.nn.init.constant_(classifier.fc2.bias, 20.0)
    return classifier


def _sampled(pipe):
    """A seeded sampled reply: its tokens depend on the trees the policy builds."""
    return pipe(make_image(4), PROMPTS[0], max_new_tokens=16, do_sample=True, seed=7)


def test_save_pretrained_into_a_file_is_refused_naming_it(pipe, tmp_path):
    """A file where the folder (or one above it) should be: the library's error, naming it, and the file kept."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(
        InvalidInputError, match=r"notes.txt': it is an existing file, not a folder; save into a new"
    ):
        pipe.save_pretrained(file)
    with pytest.raises(
        InvalidInputError, match=r"/saved': '.*notes.txt' on its path is a file, not a folder"
    ):
        pipe.save_pretrained(file / "saved")
    assert file.read_text() == "mine"


# ---- errors ---------------------------------------------------------------------------------------------------


def test_draft_from_another_family_is_refused(tiny_pairs):
    with pytest.raises(
        ValueError, match=r"draft model is a 'llava_onevision' model but the target is 'qwen2_vl'"
    ):
        VLMSpecPipeline.from_pretrained(tiny_pairs["qwen2_vl"].target, tiny_pairs["llava_onevision"].draft)


def test_draft_with_another_vocabulary_is_refused(pipe, tiny_pairs, tmp_path):
    # Padded embedding tables of different sizes are fine (real 7B/2B Qwen pairs differ so) ...
    draft = pipe.draft
    rows = pipe.target.get_input_embeddings().weight.shape[0]
    draft.resize_token_embeddings(rows + 64)
    try:
        VLMSpecPipeline(pipe.target, draft, pipe.processor)
        # ... a table that does not cover the tokenizer is not.
        draft.resize_token_embeddings(len(pipe.tokenizer) - 8)
        with pytest.raises(
            ValueError, match="draft's vocabulary has .* entries but the target's tokenizer has"
        ):
            VLMSpecPipeline(pipe.target, draft, pipe.processor)
    finally:
        draft.resize_token_embeddings(rows)
    # A draft saved with a different tokenizer is refused at load time.
    other = tmp_path / "draft"
    shutil.copytree(tiny_pairs["qwen2_vl"].draft, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<|not_in_target|>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="draft's tokenizer differs from the target's"):
        VLMSpecPipeline.from_pretrained(tiny_pairs["qwen2_vl"].target, other)


def test_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="target model folder .*does not exist"):
        VLMSpecPipeline.from_pretrained(tmp_path / "nope", tmp_path / "nope2")


def test_unknown_policy_and_bad_option(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="fastest")
    with pytest.raises(ValueError, match=r"SAGEConfig.n_max=0"):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", n_max=0)


def test_missing_and_corrupt_images(pipe, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"image file '.*missing.png' does not exist"):
        pipe(tmp_path / "missing.png", PROMPTS[0])
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match=r"image file '.*bad.jpg' could not be read"):
        pipe(bad, PROMPTS[0])


def test_missing_empty_and_corrupt_videos(pipe, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"video file '.*nope.mp4' does not exist"):
        pipe(None, PROMPTS[0], video=tmp_path / "nope.mp4")
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"video file '.*empty.mp4' is empty"):
        pipe(None, PROMPTS[0], video=empty)
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(ValueError, match=r"video file '.*corrupt.mp4' could not be decoded"):
        pipe(None, PROMPTS[0], video=corrupt)


def test_prompt_longer_than_context_is_refused(pipe):
    limit = pipe.target.config.get_text_config().max_position_embeddings
    with pytest.raises(ValueError, match=r"more than the target's context of \d+ tokens"):
        pipe(None, "word " * limit, max_new_tokens=8)


def test_bad_generation_arguments(pipe):
    with pytest.raises(ValueError, match=r"max_new_tokens=0"):
        pipe(None, PROMPTS[0], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"temperature=0"):
        pipe(None, PROMPTS[0], do_sample=True, temperature=0)
    with pytest.raises(ValueError, match=r"top_p=1.5"):
        pipe(None, PROMPTS[0], do_sample=True, top_p=1.5)
    with pytest.raises(TypeError, match="prompt must be a string"):
        pipe(None, 123)


def test_greedy_calls_warn_that_they_ignore_sampling_settings(pipe):
    greedy = pipe(None, PROMPTS[0], max_new_tokens=6)
    with pytest.warns(
        UserWarning, match=r"greedy decoding ignores temperature=0.7, top_k=5; pass do_sample=True"
    ) as w:
        out = pipe(None, PROMPTS[0], max_new_tokens=6, temperature=0.7, top_k=5)
    assert out.token_ids == greedy.token_ids
    assert [r.filename for r in w] == [__file__]  # points at the caller's line, not the library's


def test_demo_command_on_the_tiny_pair(capsys, tiny_root, monkeypatch):
    monkeypatch.setenv("VLMSPEC_CACHE", str(tiny_root))
    assert cli_main(["demo", "--pair", "tiny", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "caption:" in out and "tau=" in out and "tokens/s=" in out and "SAGE trace" in out
    assert "output vs generate(): identical" in out and "transformers generate():" in out
    assert "Using the named pair (tiny:qwen2_vl)." in out  # a named pair is not "no checkpoint named"


def test_demo_prompts_a_video_as_a_clip_and_takes_an_image_beside_it(
    capsys, tiny_root, monkeypatch, tmp_path
):
    monkeypatch.setenv("VLMSPEC_CACHE", str(tiny_root))
    video = write_video(tmp_path / "clip.mp4", make_video_frames(0), fps=2)
    make_image(1).save(tmp_path / "picture.png")
    argv = ["demo", "--pair", "tiny", "--max-new-tokens", "4", "--video", str(video)]
    assert cli_main(argv) == 0
    assert "prompt:    Describe what happens in this clip." in capsys.readouterr().out
    seen = []
    monkeypatch.setattr(VLMSpecPipeline, "__call__", lambda self, image, prompt, **kw: seen.append(image) or
                        SimpleNamespace(text="", token_ids=[], stats=SpecStats()))  # fmt: skip
    assert cli_main([*argv, "--image", str(tmp_path / "picture.png")]) == 0
    assert seen and all(image == str(tmp_path / "picture.png") for image in seen)  # kept beside the video


def test_pct_cost_ratio_is_measured_on_the_pair_at_load_time(pipe):
    pipe.policy = get_policy("pct")
    assert pipe.policy.cost_ratio is not None and 0 < pipe.policy.cost_ratio < 100
    pipe.policy = get_policy("pct", cost_ratio=0.25)  # a configured ratio is kept as it is
    assert pipe.policy.cost_ratio == 0.25
    pipe.policy = "sage"
