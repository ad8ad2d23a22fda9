"""Damaged, foreign or inconsistent artifact files (a C2T classifier and its spec, C2T training data, an EDD draft
folder) and bad training settings are refused with a :class:`VLMSpecError` naming the file or flag, what is wrong
and what to do, never a raw ``JSONDecodeError``, ``SafetensorError``, ``KeyError`` or shape ``RuntimeError``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmspec.c2t_tools import main as c2t_main
from vlmspec.c2t_tools import train
from vlmspec.errors import InputNotFoundError, InvalidInputError
from vlmspec.policies import C2TClassifier, get_policy
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
