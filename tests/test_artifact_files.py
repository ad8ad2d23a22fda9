"""Damaged, foreign or inconsistent artifact files (a C2T classifier and its spec, C2T training data, an EDD draft
folder) and bad training settings are refused with a :class:`VLMSpecError` naming the file or flag, what is wrong
and what to do, never a raw ``JSONDecodeError``, ``SafetensorError``, ``KeyError`` or shape ``RuntimeError``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from synthetic import synthetic_tree

from vlmspec import VLMSpecPipeline
from vlmspec.c2t_tools import main as c2t_main
from vlmspec.c2t_tools import train
from vlmspec.errors import InputNotFoundError, InvalidInputError
from vlmspec.models.edd import CONFIG_NAME, WEIGHTS_NAME, EDDDraft
from vlmspec.policies import C2TClassifier, SAGEConfig, SAGEPolicy, confidence, get_policy
from vlmspec.policies.c2t import spec_path


# ---- C2T classifier files ----------------------------------------------------------------------------------------
@pytest.fixture
def classifier(tmp_path) -> Path:
    """A valid (untrained) classifier's weights; its spec sits next to it."""
    torch.manual_seed(0)
    return C2TClassifier(hidden=8).save(tmp_path / "clf.safetensors")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


C2T_DAMAGE = {
    "spec not JSON": lambda w: spec_path(w).write_text("{oops"),
    "spec a JSON list": lambda w: spec_path(w).write_text("[]"),
    "4-feature weights": lambda w: save_file(
        {**_tensors(w), "fc1.weight": torch.randn(8, 4), "mean": torch.zeros(4), "std": torch.ones(4)}, str(w)
    ),
    "no fc2": lambda w: save_file({k: v for k, v in _tensors(w).items() if not k.startswith("fc2")}, str(w)),
    "foreign weights": lambda w: save_file({"decoder.weight": torch.zeros(2, 2)}, str(w)),
    "truncated weights": lambda w: w.write_bytes(w.read_bytes()[:100]),
    "garbage weights": lambda w: w.write_bytes(b"\0" * 64),
    "NaN weights": lambda w: save_file({**_tensors(w), "fc2.bias": torch.tensor([float("nan")])}, str(w)),
}


@pytest.mark.parametrize("damage", list(C2T_DAMAGE))
def test_a_damaged_c2t_classifier_is_refused_naming_its_file(classifier, damage):
    C2T_DAMAGE[damage](classifier)
    with pytest.raises(InvalidInputError) as info:
        C2TClassifier.load(classifier)
    message = str(info.value)
    assert classifier.stem in message and "vlmspec c2t train" in message
    with pytest.raises(InvalidInputError):  # the policy option (`vlmspec demo --policy-options`) the same
        get_policy("c2t", classifier=str(classifier))


def test_a_c2t_classifier_without_its_spec_is_refused(classifier):
    spec_path(classifier).unlink()
    with pytest.raises(InputNotFoundError, match="clf.json"):
        C2TClassifier.load(classifier)


def test_an_intact_c2t_classifier_loads(classifier):
    assert C2TClassifier.load(classifier).hidden == 8


# ---- C2T training data and settings ------------------------------------------------------------------------------
def _trees(path: Path, n: int = 40, features: torch.Tensor | None = None, labels=None, tree=None) -> Path:
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            "features": torch.rand(n, 3, generator=gen) if features is None else features,
            "labels": (torch.arange(n) % 4 == 0).float() if labels is None else labels,
            "tree": torch.arange(n) // 8 if tree is None else tree,
        },
        str(path),
    )
    return path


BAD_DATA = {
    "all positive": ({"labels": torch.ones(40)}, "every label is 1"),
    "all negative": ({"labels": torch.zeros(40)}, "every label is 0"),
    "NaN feature": ({"features": torch.rand(40, 3).index_fill_(0, torch.tensor([3]), float("nan"))}, "NaN"),
    "inf feature": (
        {"features": torch.rand(40, 3).index_fill_(0, torch.tensor([3]), float("inf"))},
        "infinite",
    ),
    "4 columns": ({"features": torch.rand(40, 4)}, r"\[40, 4\]"),
    "labels not 0/1": ({"labels": torch.full((40,), 2.0)}, "other than 0"),
    "short labels": ({"labels": torch.ones(39)}, "different numbers of nodes"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_c2t_train_refuses_bad_data_naming_the_file(tmp_path, case):
    change, problem = BAD_DATA[case]
    data = _trees(tmp_path / "trees.safetensors", **change)
    with pytest.raises(InvalidInputError, match=problem) as info:
        train(data, tmp_path / "clf.safetensors", epochs=1)
    assert "trees.safetensors" in str(info.value) and not (tmp_path / "clf.safetensors").exists()


def test_c2t_train_refuses_a_garbage_data_file(tmp_path):
    data = tmp_path / "trees.safetensors"
    data.write_bytes(b"not a safetensors file at all")
    with pytest.raises(InvalidInputError, match="trees.safetensors.*vlmspec c2t collect"):
        train(data, tmp_path / "clf.safetensors", epochs=1)
    with pytest.raises(InputNotFoundError, match="missing.safetensors"):
        train(tmp_path / "missing.safetensors", tmp_path / "clf.safetensors", epochs=1)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--neg-ratio", "-1"),
        ("--neg-ratio", "0"),
        ("--lr", "0"),
        ("--lr", "nan"),
        ("--beta", "2"),
        ("--beta", "1"),
    ],
)
def test_c2t_train_refuses_bad_settings_naming_the_flag(tmp_path, flag, value):
    data = _trees(tmp_path / "trees.safetensors")
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "clf.safetensors"), flag, value]
    with pytest.raises(InvalidInputError, match=f"\\({flag}\\)"):
        c2t_main(argv)
    assert not (tmp_path / "clf.safetensors").exists()


def test_c2t_train_accepts_good_data(tmp_path):
    metrics = train(_trees(tmp_path / "trees.safetensors"), tmp_path / "clf.safetensors", epochs=1)
    assert 0 <= metrics["recall"] <= 1
    assert C2TClassifier.load(tmp_path / "clf.safetensors").hidden == 48


# ---- EDD draft folders -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_target(tiny_pairs) -> torch.nn.Module:
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="ar", torch_dtype=torch.float32
    ).target


@pytest.fixture
def edd_folder(tiny_target, tmp_path) -> Path:
    return EDDDraft.for_target(tiny_target).save_pretrained(tmp_path / "edd")


def _edit_config(folder: Path, **changes) -> None:
    path = folder / CONFIG_NAME
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if key.startswith("text_config."):
            config["text_config"][key.split(".", 1)[1]] = value
        else:
            config[key] = value if not callable(value) else value(config[key])
    path.write_text(json.dumps(config))


EDD_DAMAGE = {
    "truncated weights": (lambda d: (d / WEIGHTS_NAME).write_bytes((d / WEIGHTS_NAME).read_bytes()[:1000]), WEIGHTS_NAME),
    "garbage weights": (lambda d: (d / WEIGHTS_NAME).write_bytes(b"\0" * 100), WEIGHTS_NAME),
    "config not JSON": (lambda d: (d / CONFIG_NAME).write_text("{oops"), CONFIG_NAME),
    "config a JSON list": (lambda d: (d / CONFIG_NAME).write_text("[1, 2]"), CONFIG_NAME),
    "heads edited": (lambda d: _edit_config(d, **{"text_config.num_attention_heads": 3}), "num_attention_heads"),
    "intermediate size edited": (lambda d: _edit_config(d, **{"text_config.intermediate_size": 100}), "intermediate_size"),
    "short signature": (lambda d: _edit_config(d, target_signature=lambda s: s[:3]), "target_signature"),
    "hidden_layer past the last layer": (lambda d: _edit_config(d, hidden_layer=17), "hidden_layer is 17"),
    "hidden_layer negative": (lambda d: _edit_config(d, hidden_layer=-1), "hidden_layer is -1"),
    "hidden_layer not an int": (lambda d: _edit_config(d, hidden_layer="2"), "hidden_layer"),
    "weights of another shape": (
        lambda d: save_file({k: v[..., :1].contiguous() for k, v in load_file(str(d / WEIGHTS_NAME)).items()},
                            str(d / WEIGHTS_NAME)),
        WEIGHTS_NAME,
    ),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(EDD_DAMAGE))
def test_a_damaged_edd_folder_is_refused_at_load_naming_the_folder_and_field(edd_folder, tiny_target, damage):
    change, field = EDD_DAMAGE[damage]
    change(edd_folder)
    with pytest.raises(InvalidInputError) as info:
        EDDDraft.from_pretrained(edd_folder, tiny_target)
    assert str(edd_folder) in str(info.value) and field in str(info.value)


def test_an_edd_folder_without_weights_is_refused(edd_folder, tiny_target):
    (edd_folder / WEIGHTS_NAME).unlink()
    with pytest.raises(InputNotFoundError, match=f"{edd_folder}/{WEIGHTS_NAME}.*vlmspec edd train"):
        EDDDraft.from_pretrained(edd_folder, tiny_target)


def test_an_intact_edd_folder_loads(edd_folder, tiny_target):
    assert EDDDraft.from_pretrained(edd_folder, tiny_target).edd_config.hidden_layer >= 0


# ---- a broken draft (NaN distributions) under SAGE ---------------------------------------------------------------
def _nan_draft(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return torch.full((tokens.shape[0], 32), float("nan"))


@pytest.mark.parametrize("source", ["lookahead", "root"])
def test_sage_takes_a_nan_draft_distribution_as_zero_confidence(source):
    assert float(confidence(torch.full((32,), float("nan")), 10)) == 0.0
    by_cost = SAGEPolicy(
        SAGEConfig(confidence=source)
    )  # growth by cost: NaN clears no bar, the tree is empty
    draft, _ = synthetic_tree(_nan_draft)
    assert by_cost.build_tree(draft).num_nodes == 0 and by_cost.trace()["depth"] == 0
    policy = SAGEPolicy(SAGEConfig(growth="paper", confidence=source))
    for _ in range(2):  # under lookahead the second step's shape comes from the first's (NaN) confidence
        draft, _ = synthetic_tree(_nan_draft)
        tree = policy.build_tree(draft)
        assert 0 <= tree.num_nodes <= policy.config.n_max
    trace = policy.trace()
    assert trace["alpha"] == 0.0 and trace["width"] == policy.config.width(0.0)
    assert trace["depth"] == policy.config.depth(0.0, trace["max_depth"])
