"""Loading a pair from folders: what is refused at load (and how it is named), what loads that did not."""

from __future__ import annotations

import pytest
import torch

from vlmspec import InvalidInputError, VLMSpecPipeline
from vlmspec.loading import check_dtype


@pytest.mark.parametrize("dtype", ["int8", "bool", torch.int64, {"text_config": "float32", "": "uint8"}])
def test_a_dtype_that_is_not_floating_point_is_refused_before_loading(tiny_pairs, dtype):
    with pytest.raises(
        InvalidInputError, match=r"is invalid: torch\.\w+ is not a floating-point dtype; use 'auto'"
    ):
        check_dtype(dtype)
    pair = tiny_pairs["qwen2_vl"]
    with pytest.raises(InvalidInputError, match=r"not a floating-point dtype"):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, torch_dtype=dtype)
