"""oneDNN linears (vlmspec.kernels): rerouted only inside the block, numerically torch's, lossless end to end."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vlmspec import VLMSpecPipeline, get_policy, testbed
from vlmspec.errors import InvalidInputError
from vlmspec.kernels import (
    ENV_CUDNN_ATTENTION,
    MIN_WEIGHT_ELEMENTS,
    cudnn_attention_default,
    onednn_available,
    onednn_linears,
    without_cudnn_attention,
)

pytestmark = pytest.mark.skipif(
    not onednn_available(), reason="this torch build has no oneDNN (mkldnn) CPU backend"
)


def test_large_fp32_cpu_linears_are_rerouted_inside_the_block_only() -> None:
    torch.manual_seed(0)
    big = torch.nn.Linear(1024, MIN_WEIGHT_ELEMENTS // 1024 + 8)
    small = torch.nn.Linear(64, 64)
    half = torch.nn.Linear(1024, 1024).to(torch.bfloat16)
    model = torch.nn.ModuleDict({"big": big, "small": small, "bf16": half})
    x = torch.randn(2, 5, 1024)
    expected, expected_row = big(x), big(x[0, :1])
    with onednn_linears(model, None) as rerouted:
        assert rerouted == 1 and "forward" in vars(big)
        assert not {"forward"} & (vars(small).keys() | vars(half).keys())
        with onednn_linears(model) as nested:  # an enclosing block already rerouted it: this one holds it too
            assert nested == 1
        assert "forward" in vars(big)
        out = big(x)
        one_row = big(x[0, :1])
    assert torch.equal(one_row, expected_row)  # one row keeps torch's (memory-bound) vector product
    assert "forward" not in vars(big)  # nothing left on the model
    assert out.shape == expected.shape and not torch.equal(out, expected)  # another kernel ...
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)  # ... with torch's numbers


def check_the_last_block_out_undoes_it(block: Callable[[], Any], held: Callable[[], bool]) -> None:
    """Two calls decoding at once (two threads): what ``block`` sets (``held``) stays while the second block is open
    after the first one has left, and is undone when the last one leaves."""
    entered, checked, left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with block():
            entered.set()
            checked.wait(10)
        left.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert entered.wait(10) and held()
        with block():
            checked.set()
            assert left.wait(10) and held()  # the first block has left; this one is still open
    finally:
        checked.set()
        thread.join(10)
    assert not held()


def test_a_block_in_another_thread_keeps_the_layers_rerouted_until_it_leaves() -> None:
    layer = torch.nn.Linear(1024, 1024)
    check_the_last_block_out_undoes_it(lambda: onednn_linears(layer), lambda: "forward" in vars(layer))


def test_cudnn_attention_is_off_while_any_decoding_block_is_open() -> None:
    """SDPA's cuDNN backend (a plan per new query/key length) is off from the first block's entry to the last
    one's exit, whichever thread closes first, and torch's setting is back after, an error or not."""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled
    assert cudnn()
    check_the_last_block_out_undoes_it(without_cudnn_attention, lambda: not cudnn())
    with pytest.raises(RuntimeError, match="boom"), without_cudnn_attention():
        raise RuntimeError("boom")
    assert cudnn()


def test_the_cudnn_attention_setting_comes_from_its_environment_variable(monkeypatch) -> None:
    assert cudnn_attention_default() is False
    monkeypatch.setenv(ENV_CUDNN_ATTENTION, "1")
    assert cudnn_attention_default() is True
    monkeypatch.setenv(ENV_CUDNN_ATTENTION, "yes")
    with pytest.raises(InvalidInputError, match=f"{ENV_CUDNN_ATTENTION}='yes': use 1 .* or 0"):
        cudnn_attention_default()


def test_exception_inside_the_block_restores_the_layers() -> None:
    layer = torch.nn.Linear(1024, 1024)
    with pytest.raises(RuntimeError, match="boom"), onednn_linears(layer):
        raise RuntimeError("boom")
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("task", ["image_caption", "video_caption"])
def test_calibrated_pair_with_onednn_equals_generate(task: str) -> None:
    # SAGE's tree set by hand (the calibrated CPU pair's measured costs, SAGE's defaults): fitted to a probe taken
    # while other tests load the machine, its trees can shrink to nothing, and no draft would be exercised
    sage = get_policy("sage", n_max=16, d_max=6, node_cost=0.02, level_cost=0.05)
    pipe = VLMSpecPipeline.from_pretrained("testbed-mini@cpu", policy=sage)
    assert pipe.onednn_linears and not pipe.cudnn_attention
    with pipe.kernels() as rerouted:
        assert rerouted > 0  # the 1024-wide calibrated target's layers run through oneDNN
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    example = testbed.sample(task, 11)
    inputs = pipe.prepare_inputs(example.image, example.prompt, example.video)
    expected = pipe.reference_generate(inputs, 48)  # transformers' generate() with torch's own kernels
    out = pipe(example.image, example.prompt, video=example.video, max_new_tokens=48)
    assert out.token_ids == expected and out.stats.accepted_tokens > 0
    pipe.onednn_linears, pipe.cudnn_attention = False, True
    with pipe.kernels() as rerouted:
        assert rerouted == 0 and torch.backends.cuda.cudnn_sdp_enabled()
