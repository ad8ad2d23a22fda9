"""EDD drafts (vlmspec.models.edd, vlmspec.edd_train): lossless with every tree policy and family, sampling that
follows the target, exact inflation for calibrated targets, training that resumes and refuses another target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, check_the_second_token_follows_the_target, input_kinds
from test_lossless import MAX_NEW, reference

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.edd_train import EDDTrainConfig, dual_block_mask, examples_from_testbed, train
from vlmspec.models import EDDDraft, adapter_for
from vlmspec.models.edd import default_hidden_layer
from vlmspec.testing import FAMILIES, make_image

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("chain", "sage", "eagle2", "pct", "wetap", "c2t")
"""Every kind of tree (the static and paper-literal SAGE trees verify as these do: fp32 runs them in test_lossless)."""


@pytest.fixture(scope="module", params=FAMILIES)
def edd_case(request, tiny_pairs):
    """Per family: a pipeline with an (untrained) EDD draft and the target's greedy replies to every input kind, one
    prompt each (the main matrix, ``test_lossless.py``, varies the prompts; what is the EDD draft's own here is how
    it drafts from the target's hidden states for each input kind and tree policy)."""
    pair = tiny_pairs[request.param]
    base = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    pipe = VLMSpecPipeline(base.target, EDDDraft.for_target(base.target), base.processor, policy="ar")
    cases = []
    for kind, image, video in input_kinds():
        for prompt in PROMPTS[:1]:
            cases.append(
                (kind, prompt, image, video, reference(pipe, pipe.prepare_inputs(image, prompt, video)))
            )
    return request.param, pipe, cases


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_with_an_edd_draft_equals_generate(edd_case, policy):
    family, pipe, cases = edd_case
    pipe.policy = get_policy(policy)
    accepted = 0
    for kind, prompt, image, video, expected in cases:
        out = pipe(image, prompt, video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == expected, f"{family}/{policy}/{kind}/{prompt!r}"
        assert out.stats.draft_visual_tokens == 0  # the draft sees the prompt only through the target
        accepted += out.stats.accepted_tokens
    assert accepted > 0  # the draft's proposals were used, not only the bonus tokens


def test_sampling_with_an_edd_draft_follows_the_target(tiny_pairs):
    """The second token (the first one a speculative step emits) over many seeds follows the target's own
    two-token distribution: sum over the first token t1 of p(t1) p(t2 | t1), with generate()'s warping."""
    pair = tiny_pairs["qwen2_vl"]
    base = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    pipe = VLMSpecPipeline(base.target, EDDDraft.for_target(base.target), base.processor, policy="sage")
    check_the_second_token_follows_the_target(pipe, draws=800, image=make_image(0))


def test_dual_block_mask_matches_equation_3():
    """Prompt of 3, reply of 5, blocks of 2: token row i (block start s) sees soft rows < s and tokens s..i."""
    mask = dual_block_mask(3, 8, 2, torch.float32)[0, 0] == 0  # [13, 13] visible
    soft, tokens = mask[:8], mask[8:]
    assert torch.equal(soft[:, :8], torch.ones(8, 8, dtype=torch.bool).tril()) and not soft[:, 8:].any()
    starts = [3, 3, 5, 5, 7]  # positions 3..7 in blocks [3, 4], [5, 6], [7]
    for row, (position, start) in enumerate(zip(range(3, 8), starts, strict=True)):
        assert tokens[row, :8].tolist() == [a < start for a in range(8)]
        assert tokens[row, 8:].tolist() == [start <= p <= position for p in range(3, 8)]


def test_the_target_s_probe_cannot_reach_an_edd_draft(tiny_pairs):
    """Why EDD's forwards hold no model lock: the pruning probe's eager switch and hooks are the target's, and the
    draft shares no module, weight or config with it."""
    pair = tiny_pairs["qwen2_vl"]
    base = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    target, draft = base.target, EDDDraft.for_target(base.target)
    modules = {id(m) for m in target.modules()}
    storage = {t.data_ptr() for t in (*target.parameters(), *target.buffers())}
    assert not any(id(m) in modules for m in draft.modules())
    assert not any(t.data_ptr() in storage for t in (*draft.parameters(), *draft.buffers()))
    decoder, usual = target.get_decoder(), draft.config._attn_implementation
    assert usual != "eager"
    decoder.set_attn_implementation("eager")  # what the probe does for its side pass
    try:
        assert draft.config._attn_implementation == usual
    finally:
        decoder.set_attn_implementation(usual)


def test_default_layer_keeps_the_papers_relative_depth():
    assert default_hidden_layer(32) == 27  # LLaMA2-7B: the 28th layer (the paper's "fourth-to-last")
    assert default_hidden_layer(28) == 23 and default_hidden_layer(4) == 2 and default_hidden_layer(1) == 0


def test_inflated_edd_drafts_exactly_what_the_base_one_drafts():
    """The shipped EDD draft of testbed-base, loaded with its target inflated (``@ci``) through ``draft="edd"``,
    accepts the same tokens at every step as on the target as trained."""
    runs = []
    for name in ("testbed-base", "testbed-base@ci"):
        pipe = VLMSpecPipeline.from_pretrained(
            name, draft="edd", policy="chain", gamma=5, torch_dtype=torch.float32
        )
        assert isinstance(pipe.draft, EDDDraft)
        hidden = pipe.target.config.get_text_config().hidden_size
        assert pipe.draft.decoder.config.hidden_size == hidden
        out = pipe(make_image(3), "Describe this image.", max_new_tokens=32)
        runs.append((out.token_ids, [step["accepted"] for step in out.stats.trace]))
    assert runs[0] == runs[1] and sum(runs[0][1]) > 0


def test_named_edd_draft_errors_say_what_to_do():
    with pytest.raises(ValueError, match="no EDD draft ships"):
        VLMSpecPipeline.from_pretrained("testbed-mini", draft="edd")
    with pytest.raises(ValueError, match="not one; train an EDD draft"):
        VLMSpecPipeline.from_pretrained("Qwen/Qwen2-VL-2B-Instruct", draft="edd")


def test_a_draft_for_another_target_is_refused(tmp_path):
    qwen = VLMSpecPipeline.from_pretrained("testbed-mini", policy="ar", torch_dtype=torch.float32)
    llava = VLMSpecPipeline.from_pretrained(
        "testbed-mini:llava_onevision", policy="ar", torch_dtype=torch.float32
    )
    folder = EDDDraft.for_target(qwen.target, target_name="testbed-mini").save_pretrained(tmp_path / "edd")
    loaded = EDDDraft.from_pretrained(folder, qwen.target)  # its own target: fine, weights round-trip
    fresh = EDDDraft.for_target(qwen.target).state_dict()
    assert all(torch.equal(value, fresh[name]) for name, value in loaded.state_dict().items())
    with pytest.raises(ValueError, match="trained for a 'qwen2_vl' target, not 'llava_onevision'"):
        EDDDraft.from_pretrained(folder, llava.target)
    with torch.no_grad():
        qwen.target.get_output_embeddings().weight.mul_(1.5)  # same shape, other weights
    with pytest.raises(ValueError, match="same shape but other weights"):
        EDDDraft.from_pretrained(folder, qwen.target)
    with pytest.raises(ValueError, match="trained for a 'qwen2_vl' target"):
        train(
            llava,
            examples_from_testbed(2),
            tmp_path / "edd",
            EDDTrainConfig(max_new_tokens=4),
            progress=False,
        )


@pytest.mark.slow
def test_training_runs_end_to_end_and_resumes_after_a_kill(tmp_path, capsys):
    """`vlmspec edd train` on 48 testbed examples (tiny size): killed after its first checkpoint and started again,
    it resumes there and ends with exactly the weights of an uninterrupted run."""
    args = ["--target", "testbed-mini", "--data", "testbed", "--examples", "48", "--max-new-tokens", "16",
            "--batch-size", "4", "--epochs", "2", "--lr", "1e-3", "--checkpoint-every", "1", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "vlmspec.cli", "edd", "train", *args, "--out", str(killed)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = killed / "checkpoint" / "progress.json"
    deadline = time.monotonic() + 300
    while not progress.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    stopped_at = json.loads(progress.read_text())["step"]
    assert stopped_at < 23, "the run finished before it could be killed"  # 48 / 4 * 2 = 24 steps
    from vlmspec.cli import main as cli_main  # started again in this process, past Python's imports

    assert cli_main(command[3:]) == 0
    assert "wrote" in capsys.readouterr().out

    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "data.safetensors").write_bytes(
        (killed / "data.safetensors").read_bytes()
    )  # same replies, reused
    pipe = VLMSpecPipeline.from_pretrained("testbed-mini", policy="ar", torch_dtype=torch.float32)
    config = EDDTrainConfig(max_new_tokens=16, batch_size=4, epochs=2, lr=1e-3, checkpoint_every=1000)
    reference_draft = train(pipe, examples_from_testbed(48), clean, config, progress=False)
    resumed = EDDDraft.from_pretrained(killed, pipe.target)
    for (name, a), b in zip(resumed.state_dict().items(), reference_draft.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    saved = json.loads((killed / "edd_config.json").read_text())
    assert saved["training"]["steps"] == 24 and saved["target_name"] == "testbed-mini"
    # A trained draft proposes tokens the target accepts.
    with_edd = VLMSpecPipeline(pipe.target, resumed, pipe.processor, policy="chain")
    out = with_edd(make_image(5), "Describe this image.", max_new_tokens=32)
    assert out.token_ids == pipe.reference_generate(
        pipe.prepare_inputs(make_image(5), "Describe this image."), 32
    )
    assert adapter_for(resumed).reads_target_layer == resumed.edd_config.hidden_layer


def test_edd_eval_takes_the_shipped_draft_by_name(tmp_path, monkeypatch, capsys):
    from vlmspec.edd_train import main as edd_main

    monkeypatch.chdir(
        tmp_path
    )  # no folder named "edd" here: the name means the draft shipped with the target
    argv = [
        "eval",
        "--target",
        "testbed-base",
        "--draft",
        "edd",
        "--data",
        "testbed",
        "--examples",
        "1",
        "--block",
        "4",
    ]
    assert edd_main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["draft"] == "edd" and result["accepted"] > 0


# ---- training state in --out: settings, data key, crash-safe checkpoints, input checks ------------------------------
@pytest.fixture(scope="module")
def mini():
    return VLMSpecPipeline.from_pretrained("testbed-mini", policy="ar", torch_dtype=torch.float32)


def _config(**changes):
    settings = dict(max_new_tokens=4, batch_size=2, epochs=2, lr=1e-3, checkpoint_every=1)
    return EDDTrainConfig(**{**settings, **changes})


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"lr": 2e-3}, "--lr 0.001, this run has --lr 0.002"),
        ({"use_hidden": False}, "no --no-hidden, this run has --no-hidden"),
        ({"weight_decay": 0.1}, "--weight-decay 0.0, this run has --weight-decay 0.1"),
        ({"teacher_top_k": 8}, "other self-distillation data"),
    ],
)
def test_a_resume_with_other_settings_is_refused(mini, tmp_path, changes, flag):
    from vlmspec.edd_state import CheckpointError

    examples = examples_from_testbed(4)
    train(mini, examples, tmp_path, _config(), progress=False)
    recorded = (tmp_path / "edd_config.json").read_text()
    with pytest.raises(CheckpointError, match=flag) as error:
        train(mini, examples, tmp_path, _config(**changes), progress=False)
    assert "rerun with the checkpoint's flags" in str(error.value) and "new --out" in str(error.value)
    assert (tmp_path / "edd_config.json").read_text() == recorded  # nothing recorded from the refused run
    train(mini, examples, tmp_path, _config(checkpoint_every=5), progress=False)  # when to checkpoint: free


def test_stale_self_distillation_data_is_regenerated(mini, tmp_path):
    import shutil

    from safetensors.torch import load_file

    train(mini, examples_from_testbed(4), tmp_path, _config(epochs=1), progress=False)
    first = load_file(str(tmp_path / "data.safetensors"))
    shutil.rmtree(tmp_path / "checkpoint")  # start afresh, keeping the data: other top-k, other examples
    train(mini, examples_from_testbed(4), tmp_path, _config(epochs=1, teacher_top_k=8), progress=False)
    assert load_file(str(tmp_path / "data.safetensors"))["0.top_ids"].shape[-1] == 8
    shutil.rmtree(tmp_path / "checkpoint")
    train(
        mini, examples_from_testbed(4, seed=1), tmp_path, _config(epochs=1, teacher_top_k=8), progress=False
    )
    third = load_file(str(tmp_path / "data.safetensors"))
    assert not all(torch.equal(third[f"{i}.tokens"], first[f"{i}.tokens"]) for i in range(4))


@pytest.mark.parametrize("crash", ["optimizer", "commit"])
def test_a_crash_while_checkpointing_resumes_from_a_whole_checkpoint(mini, tmp_path, monkeypatch, crash):
    """Killed after the 3rd checkpoint's weights (before its optimizer state), or just before its commit: the
    next run resumes from the 2nd checkpoint, whole, and ends with the weights of an uninterrupted run."""
    import vlmspec.edd_state as state

    examples = examples_from_testbed(6)
    reference_draft = train(mini, examples, tmp_path / "clean", _config(), progress=False)
    name = "save_file" if crash == "optimizer" else "write_json_atomic"
    real = getattr(state, name)
    calls = []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(state, name, crashing)
    with pytest.raises(KeyboardInterrupt):
        train(mini, examples, tmp_path / "killed", _config(), progress=False)
    monkeypatch.undo()
    assert json.loads((tmp_path / "killed/checkpoint/progress.json").read_text())["step"] == 1
    resumed = train(mini, examples, tmp_path / "killed", _config(), progress=False)
    for (key, a), b in zip(resumed.state_dict().items(), reference_draft.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), key


def test_a_crash_while_writing_the_trained_draft_leaves_the_earlier_one_whole(tmp_path):
    """The final draft is written beside the earlier one and renamed over it: a kill in the middle of writing its
    weights leaves the earlier draft's files as they were (only the staging folder, which the next run clears)."""
    from vlmspec.edd_state import check_out_folder, save_draft

    class Draft:
        def __init__(self, weights: bytes, crash: bool = False) -> None:
            self.weights, self.crash = weights, crash

        def save_pretrained(self, folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "edd_config.json").write_text(json.dumps({"weights": len(self.weights)}))
            (Path(folder) / "model.safetensors").write_bytes(self.weights[:3])
            if self.crash:
                raise KeyboardInterrupt("simulated kill")
            (Path(folder) / "model.safetensors").write_bytes(self.weights)

    save_draft(Draft(b"earlier weights"), tmp_path)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        save_draft(Draft(b"new weights!", crash=True), tmp_path)
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()} == before
    check_out_folder(tmp_path)  # the leftover staging folder is the job's own
    save_draft(Draft(b"new weights!"), tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == b"new weights!"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["edd_config.json", "model.safetensors"]


def test_a_damaged_checkpoint_says_which_file_and_what_to_do(mini, tmp_path):
    from vlmspec.edd_state import CheckpointError

    examples = examples_from_testbed(2)
    train(mini, examples, tmp_path, _config(epochs=1), progress=False)
    progress = tmp_path / "checkpoint" / "progress.json"
    weights = tmp_path / "checkpoint" / json.loads(progress.read_text())["folder"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{weights} is damaged .*delete {tmp_path / 'checkpoint'}"):
        train(mini, examples, tmp_path, _config(epochs=1), progress=False)
    progress.write_text('{"step": ')
    with pytest.raises(CheckpointError, match="progress.json is damaged"):
        train(mini, examples, tmp_path, _config(epochs=1), progress=False)


def test_training_inputs_are_checked(mini, tmp_path):
    from vlmspec.c2t_tools import load_examples
    from vlmspec.edd_train import main as edd_main
    from vlmspec.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="weight_decay"):
        EDDTrainConfig(weight_decay=-0.1)
    data = tmp_path / "x.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(InvalidInputError, match=f"{data}:2: not valid JSON"):
        load_examples(data)
    data.write_text('{"prompt": "a"}\n"just a string"\n')
    with pytest.raises(InvalidInputError, match=f"{data}:2: a JSON str, not an object"):
        load_examples(data)
    data.write_text("")
    with pytest.raises(InvalidInputError, match="holds no examples"):
        edd_main(["eval", "--target", "testbed-mini", "--draft", str(tmp_path), "--data", str(data)])
    (tmp_path / "mine.txt").write_text("the user's")
    with pytest.raises(InvalidInputError, match="holds no EDD training run"):
        train(mini, examples_from_testbed(1), tmp_path, _config(), progress=False)


def test_a_killed_self_distillation_resumes_where_it_stopped(mini, tmp_path, monkeypatch):
    import vlmspec.edd_train as edd_train

    real, calls = edd_train.distill_example, []

    def counting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(edd_train, "distill_example", counting)
    with pytest.raises(KeyboardInterrupt):
        train(mini, examples_from_testbed(4), tmp_path, _config(epochs=1), progress=False)
    assert (
        not (tmp_path / "data.safetensors").exists() and len(list((tmp_path / "data-parts").iterdir())) == 3
    )
    calls.clear()
    train(mini, examples_from_testbed(4), tmp_path, _config(epochs=1), progress=False)
    assert len(calls) == 2 and not (tmp_path / "data-parts").exists()  # examples 3 and 4 only
