"""Loading a pair from folders: what is refused at load (and how it is named), what loads that did not."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from vlmspec import InvalidInputError, VLMSpecPipeline
from vlmspec.loading import _load_tokenizer, check_dtype


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
