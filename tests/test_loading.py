"""Loading a pair from folders: what is refused at load (and how it is named), what loads that did not."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlmspec import InputNotFoundError, InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.loading import _load_tokenizer, check_dtype
from vlmspec.testing import make_image


@pytest.mark.parametrize("dtype", ["int8", "bool", torch.int64, {"text_config": "float32", "": "uint8"}])
def test_a_dtype_that_is_not_floating_point_is_refused_before_loading(tiny_pairs, dtype):
    with pytest.raises(
        InvalidInputError, match=r"is invalid: torch\.\w+ is not a floating-point dtype; use 'auto'"
    ):
        check_dtype(dtype)
    pair = tiny_pairs["qwen2_vl"]
    with pytest.raises(InvalidInputError, match=r"not a floating-point dtype"):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, torch_dtype=dtype)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_a_draft_saved_without_tokenizer_files_uses_the_target_s(tiny_pairs, tmp_path, family):
    """A distillation script's ``model.save_pretrained(out)`` writes no tokenizer; the draft is the target's."""
    pair = tiny_pairs[family]
    AutoModelForImageTextToText.from_pretrained(pair.draft).save_pretrained(tmp_path / "draft")
    assert _load_tokenizer(tmp_path / "draft", False) is None
    pipe = VLMSpecPipeline.from_pretrained(pair.target, tmp_path / "draft", policy="chain", gamma=2)
    assert pipe(None, "Hello", max_new_tokens=4).stats.new_tokens == 4


def _draft_variant(source, out, edit):
    """The draft at ``source`` with its config edited by ``edit``, saved with its tokenizer into ``out``: weights
    whose shape the edit changes are freshly drawn, the others copied."""
    config = AutoConfig.from_pretrained(source)
    edit(config)
    base = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    torch.manual_seed(0)
    model = type(base)(config).eval()
    weights = base.state_dict()
    model.load_state_dict(
        {
            k: weights[k] if k in weights and weights[k].shape == v.shape else v
            for k, v in model.state_dict().items()
        }
    )
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("qwen2_vl", "vision_config.spatial_merge_size", 1),
        ("qwen2_5_vl", "vision_config.patch_size", 16),
        ("qwen3_vl", "vision_config.temporal_patch_size", 1),
        ("llava_onevision", "vision_config.patch_size", 7),
        ("llava_onevision", "vision_feature_select_strategy", "default"),
    ],
)
def test_a_draft_that_lays_out_visual_tokens_otherwise_is_refused_at_load(
    tiny_pairs, tmp_path, family, field, value
):
    pair = tiny_pairs[family]
    *parents, name = field.split(".")
    draft = _draft_variant(
        pair.draft,
        tmp_path / "draft",
        lambda c: setattr(getattr(c, parents[0]) if parents else c, name, value),
    )
    with pytest.raises(
        InvalidInputError, match=rf"^the draft's {re.escape(field)} is {value!r} but the target's is"
    ):
        VLMSpecPipeline.from_pretrained(pair.target, draft, policy="chain", gamma=2)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_a_draft_with_a_smaller_vision_tower_is_accepted(tiny_pairs, tmp_path, family):
    """Depth and width of the tower do not change the visual tokens (the testbed drafts' towers are smaller)."""
    pair = tiny_pairs[family]
    depth = "depth" if family == "qwen2_vl" else "num_hidden_layers"
    draft = _draft_variant(pair.draft, tmp_path / "draft", lambda c: setattr(c.vision_config, depth, 1))
    pipe = VLMSpecPipeline.from_pretrained(pair.target, draft, policy="chain", gamma=2)
    assert pipe(make_image(0), "Describe.", max_new_tokens=4).stats.new_tokens == 4


def _padded(source, out, rows):
    """The model at ``source`` with its vocabulary padded to ``rows`` (as checkpoints of one series pad theirs
    differently), the padded ids given head rows that often win, saved with its processor into ``out``."""
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows, mean_resizing=False)
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed[old:] = 0.01 * torch.randn(embed[old:].shape, generator=draw)
        head[old:] = 30 * head[:old].std() * torch.randn(head[old:].shape, generator=draw)
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.parametrize("padded", ["target", "draft"])
def test_pairs_whose_tables_differ_in_size_decode_the_target_s_output(tiny_pairs, tmp_path, padded):
    """A padded target emits ids the draft's table lacks (fed to the draft as a stand-in); a padded draft would
    propose ids the target cannot embed (masked). Either way the output is the target's own."""
    pair = tiny_pairs["qwen2_vl"]
    rows = AutoConfig.from_pretrained(pair.target).text_config.vocab_size
    target = _padded(pair.target, tmp_path / "target", rows + 50) if padded == "target" else pair.target
    draft = _padded(pair.draft, tmp_path / "draft", rows + 50) if padded == "draft" else pair.draft
    pipe = VLMSpecPipeline.from_pretrained(target, draft, policy="chain", gamma=3, torch_dtype=torch.float32)
    for image in (None, make_image(0)):
        inputs = pipe.prepare_inputs(image, "Describe this image.")
        ref = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=24)[
            0, inputs["input_ids"].shape[1] :
        ]
        if padded == "target":
            assert (ref >= rows).any(), "the target should emit an id the draft's table lacks"
        for policy in (get_policy("chain", gamma=3), get_policy("sage", n_max=16, d_max=6)):
            pipe.policy = policy
            assert pipe(image, "Describe this image.", max_new_tokens=24).token_ids == ref.tolist()
    pipe.policy = get_policy(
        "dsbd", top_k=None, top_p=None
    )  # draft and target distributions over the same ids
    out = pipe(None, "Describe this image.", max_new_tokens=12, do_sample=True, seed=0)
    assert max(out.token_ids) < pipe.target.get_input_embeddings().weight.shape[0]


def test_a_save_that_fails_midway_leaves_the_earlier_save_as_it_was(tiny_pairs, tmp_path, monkeypatch):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", gamma=3)
    folder = tmp_path / "saved"
    pipe.save_pretrained(folder)
    (folder / "NOTES.md").write_text("mine")
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipe.draft, "save_pretrained", full_disk)
    pipe.policy = get_policy("chain", gamma=2)
    with pytest.raises(OSError, match="No space left"):
        pipe.save_pretrained(folder)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]  # nothing written beside it
    assert VLMSpecPipeline.from_pretrained(folder).policy.config.gamma == 3
    monkeypatch.undo()
    pipe.save_pretrained(folder)  # a retry replaces it, the user's file kept
    assert VLMSpecPipeline.from_pretrained(folder).policy.config.gamma == 2
    assert (folder / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_a_save_into_the_working_directory_leaves_it_in_place(tiny_pairs, tmp_path, monkeypatch):
    """The folder is never moved: saving into "." (twice: a replacement too) keeps the working directory, and a
    killed save's staging folder left inside is cleared by the next."""
    import os
    from pathlib import Path

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", gamma=3)
    here = tmp_path / "here"
    (here / ".vlmspec-saving-dead" / "target").mkdir(parents=True)  # what a killed save leaves
    monkeypatch.chdir(here)
    for gamma in (3, 2):
        pipe.policy = get_policy("chain", gamma=gamma)
        pipe.save_pretrained(".")
        assert Path(os.getcwd()) == here and VLMSpecPipeline.from_pretrained(".").policy.config.gamma == gamma
    assert sorted(p.name for p in here.iterdir()) == ["draft", "target", "vlmspec_pipeline.yaml"]


# ---- model-loading keywords ---------------------------------------------------------------------------------------
def test_attn_implementation_and_dtype_reach_both_models(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", gamma=2, attn_implementation="eager", dtype=torch.bfloat16
    )
    for model in (pipe.target, pipe.draft):
        assert model.config.get_text_config()._attn_implementation == "eager"
        assert model.dtype == torch.bfloat16
    assert pipe.policy.config.gamma == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"device": "cpu"},
            r"^'device' is an argument of the models' from_pretrained, not a policy option.*device_map=",
        ),
        ({"low_cpu_mem_usage": True}, r"^'low_cpu_mem_usage' is an argument of the models' from_pretrained"),
        (
            {"torch_dtype": "float32", "dtype": "bfloat16"},
            r"torch_dtype='float32' and dtype='bfloat16' were both",
        ),
        ({"attn_implementation": "flash_attention_2"}, r"FlashAttention cannot take; use 'sdpa'"),
    ],
)
def test_model_loading_keywords_that_are_not_taken_are_named_as_such(
    tiny_pairs, monkeypatch, options, message
):
    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", _no_weights)
    pair = tiny_pairs["qwen2_vl"]
    with pytest.raises(InvalidInputError, match=message):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", **options)


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were loaded before the inputs were checked")


# ---- checked before any weights load -------------------------------------------------------------------------------
def test_a_mistyped_draft_or_a_target_without_processor_is_reported_before_any_weights_load(
    tiny_pairs, tmp_path, monkeypatch
):
    pair = tiny_pairs["qwen2_vl"]
    target = shutil.copytree(pair.target, tmp_path / "target")
    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", _no_weights)
    with pytest.raises(InputNotFoundError, match=r"^draft model folder '\./missing-draft' does not exist"):
        VLMSpecPipeline.from_pretrained(target, "./missing-draft")
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    with pytest.raises(
        InputNotFoundError, match=rf"^target model folder '{re.escape(str(target))}' holds no processor"
    ):
        VLMSpecPipeline.from_pretrained(target, pair.draft)


def test_an_unsupported_model_or_a_draft_of_another_family_is_refused_before_any_weights_load(
    tiny_pairs, tmp_path, monkeypatch
):
    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", _no_weights)
    pair, other = tiny_pairs["internvl"], tiny_pairs["qwen2_vl"]
    with pytest.raises(
        InvalidInputError, match=r"draft model is a 'qwen2_vl' model but the target is 'internvl'"
    ):
        VLMSpecPipeline.from_pretrained(pair.target, other.draft)
    remote = shutil.copytree(pair.target, tmp_path / "remote")
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "model_type": "internvl_chat"}))
    with pytest.raises(
        InvalidInputError,
        match=rf"^the target model '{re.escape(str(remote))}': model_type 'internvl_chat' is not supported .*-hf",
    ):
        VLMSpecPipeline.from_pretrained(remote, pair.draft)
    # Qwen4-Exp: hashed n-gram embeddings and several residual streams, refused saying why and what runs it
    (remote / "config.json").write_text(json.dumps({**config, "model_type": "qwen4_exp"}))
    with pytest.raises(
        InvalidInputError,
        match=r"model_type 'qwen4_exp' is not supported .*n-grams.*recurrent layers.*generate",
    ):
        VLMSpecPipeline.from_pretrained(remote, pair.draft)
    (remote / "config.json").write_text('{"model_type": "internvl",')
    with pytest.raises(InvalidInputError, match=r"^draft model folder .*: config.json is not valid JSON"):
        VLMSpecPipeline.from_pretrained(pair.target, remote)


def test_a_chat_template_kept_only_by_the_tokenizer_is_used_and_none_is_refused_at_load(tiny_pairs, tmp_path):
    pair = tiny_pairs["qwen2_vl"]
    target = shutil.copytree(pair.target, tmp_path / "target")
    template = (target / "chat_template.jinja").read_text()
    (target / "chat_template.jinja").unlink()
    with pytest.raises(
        InvalidInputError, match=rf"^the target's processor \(from '{re.escape(str(target))}'\) has no"
    ):
        VLMSpecPipeline.from_pretrained(target, pair.draft, policy="chain")
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    pipe = VLMSpecPipeline.from_pretrained(target, pair.draft, policy="chain", gamma=2)
    assert pipe(make_image(0), "Describe.", max_new_tokens=4).stats.new_tokens == 4


# ---- what the messages say ----------------------------------------------------------------------------------------
def test_a_file_a_saved_pipeline_and_pickle_weights_are_named_for_what_they_are(tiny_pairs, tmp_path):
    pair = tiny_pairs["qwen2_vl"]
    config = re.escape(str(pair.target / "config.json"))
    with pytest.raises(
        InvalidInputError, match=rf"^target model folder '{config}' is a file, not a folder; give"
    ):
        VLMSpecPipeline.from_pretrained(pair.target / "config.json", pair.draft)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", gamma=2)
    pipe.save_pretrained(tmp_path / "saved")
    with pytest.raises(InvalidInputError, match=r"is a saved pipeline folder .*pass it as the target"):
        VLMSpecPipeline.from_pretrained(pair.target, tmp_path / "saved")
    draft = shutil.copytree(pair.draft, tmp_path / "draft")
    torch.save(load_file(draft / "model.safetensors"), draft / "pytorch_model.bin")
    (draft / "model.safetensors").unlink()
    with pytest.raises(
        InvalidInputError, match=r"^draft model folder .* holds its weights only as pickle files"
    ):
        VLMSpecPipeline.from_pretrained(pair.target, draft)
    (draft / "pytorch_model.bin").unlink()  # config.json alone
    with pytest.raises(
        InputNotFoundError, match=r"^draft model folder .* holds no weights \(no \*.safetensors"
    ):
        VLMSpecPipeline.from_pretrained(pair.target, draft)
    with pytest.raises(InputNotFoundError, match=r"^draft model folder 'ckpts/run3/draft' does not exist"):
        VLMSpecPipeline.from_pretrained(pair.target, "ckpts/run3/draft")  # a relative path, not a hub id


def test_a_home_relative_path_is_expanded(tiny_pairs, tmp_path, monkeypatch):
    pair = tiny_pairs["qwen2_vl"]
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(pair.target, tmp_path / "models" / "target")
    shutil.copytree(pair.draft, tmp_path / "models" / "draft")
    pipe = VLMSpecPipeline.from_pretrained("~/models/target", "~/models/draft", policy="chain", gamma=2)
    pipe.save_pretrained(tmp_path / "saved")
    assert VLMSpecPipeline.from_pretrained("~/saved").policy.config.gamma == 2


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_hub_id_that_cannot_be_fetched_is_named_with_its_role(tiny_pairs, monkeypatch, role):
    def offline(*args, **kwargs):
        raise OSError(
            "We couldn't connect to 'https://huggingface.co' to load the files. Check your connection."
        )

    monkeypatch.setattr(AutoConfig, "from_pretrained", offline)
    pair = tiny_pairs["qwen2_vl"]
    names = {"target": pair.target, "draft": pair.draft, role: "owner/no-such-model"}
    with pytest.raises(
        InputNotFoundError, match=rf"^{role} 'owner/no-such-model' is no local folder.*couldn't connect"
    ) as err:
        VLMSpecPipeline.from_pretrained(names["target"], names["draft"])
    assert isinstance(err.value.__cause__, OSError)


def test_weights_load_from_safetensors_only(tiny_pairs, monkeypatch):
    seen = []
    load = AutoModelForImageTextToText.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_safetensors"))
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", spy)
    pair = tiny_pairs["llava_onevision"]
    VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain")
    assert seen == [True, True]
