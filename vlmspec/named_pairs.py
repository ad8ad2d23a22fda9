"""Named model pairs: ``testbed-base``, ``testbed-mini`` and ``tiny``, each optionally ``:<family>`` and ``@<calibration>``.

These names work wherever a target is named (``VLMSpecPipeline.from_pretrained``, ``vlmspec demo``,
``vlmspec caption``, ``vlmspec bench``, lmms-eval's ``--model_args target=...``); this module is the one place that
turns them into folders.

* ``testbed-base`` / ``testbed-mini``: the trained pair of :mod:`vlmspec.testbed` (shipped with the package);
  ``base`` (calibrated, ``@cpu``) is the embedded default, ``mini`` the CI-sized one.
* ``tiny``: the tiny *randomly initialised* pair of :mod:`vlmspec.testing` (fixtures; its text is noise).
* ``@<calibration>`` (``testbed-base@cpu``, ``testbed-base:llava_onevision@7b-0.5b``): the pair inflated on load,
  in memory, to the language-model shapes of :data:`vlmspec.testbed.calibrate.CALIBRATIONS`, with the same
  outputs and a real pair's costs (``cpu``: a 105M target, 15-25x its draft; ``7b-2b``, ``7b-3b``, ``7b-0.5b``,
  ``8b-1b``, ``8b-2b``: real checkpoints' shapes, for GPUs).

The embedded default is ``testbed-base@cpu``: on the testbed's own shapes the target costs only twice its draft, so
no speculative method could be faster than plain decoding.

A folder written by ``pipe.save_pretrained`` (it holds :data:`PIPELINE_FILE`) names its own ``target/`` and
``draft/`` (:mod:`vlmspec.saving`).

No target at all means :data:`DEFAULT_PAIR`, or the name in the ``VLMSPEC_DEFAULT_PAIR`` environment variable (so a
notebook or a CI job can run the whole demo on ``testbed-mini`` without editing code). An existing folder whose
name looks like a pair name is taken as a folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidInputError
from .validation import did_you_mean

__all__ = [
    "DEFAULT_FAMILY",
    "DEFAULT_PAIR",
    "PAIR_NAMES",
    "ResolvedPair",
    "check_model_source",
    "expand_user",
    "is_pair_name",
    "is_pipeline_folder",
    "resolve_pair",
    "split_calibration",
]

PAIR_NAMES: tuple[str, ...] = ("testbed-base", "testbed-mini", "tiny")
DEFAULT_PAIR = "testbed-base@cpu"
DEFAULT_FAMILY = "qwen2_vl"
ENV_DEFAULT_PAIR = "VLMSPEC_DEFAULT_PAIR"
EDD_DRAFT = "edd"
"""``draft="edd"`` with a testbed target: the EDD draft trained for it that ships with the package."""
PIPELINE_FILE = "vlmspec_pipeline.yaml"
"""The settings file of a folder written by ``pipe.save_pretrained`` (:mod:`vlmspec.saving`)."""
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""What the hub is asked for: ``owner/name`` (every vision-language checkpoint on the hub has an owner)."""


@dataclass(frozen=True)
class ResolvedPair:
    """Where a pair's models are.

    Attributes:
        target: folder or hub id of the target.
        draft: folder or hub id of the draft (``None`` when none was named and the target is not a pair name).
        source: ``"explicit"``, ``"testbed:<size>:<family>"``, ``"tiny:<family>"`` (``"@<calibration>"``
            appended for a calibrated pair) or ``"pipeline:<folder>"`` (a saved pipeline).
        calibration: the calibration to inflate the pair to on load (``None``: load it as it is).
    """

    target: str
    draft: str | None
    source: str
    calibration: str | None = None


def _split(name: str) -> tuple[str, str]:
    base, _, family = name.partition("@")[0].partition(":")
    return base, family or DEFAULT_FAMILY


def split_calibration(name: str) -> tuple[str, str | None]:
    """``("testbed-base:qwen2_vl", "cpu")`` for ``"testbed-base:qwen2_vl@cpu"``; ``(name, None)`` without ``@``."""
    base, at, calibration = str(name).partition("@")
    return base, (calibration if at else None)


def is_pair_name(target: str | Path | None) -> bool:
    """Whether ``target`` is one of :data:`PAIR_NAMES` (optionally ``:<family>``, ``@<calibration>``) and not an
    existing path."""
    if target is None:
        return False
    text = str(target)
    return _split(text)[0] in PAIR_NAMES and not Path(text).exists()


def is_pipeline_folder(target: str | Path | None) -> bool:
    """Whether ``target`` is a folder written by ``pipe.save_pretrained`` (it holds :data:`PIPELINE_FILE`)."""
    return target is not None and (Path(str(target)).expanduser() / PIPELINE_FILE).is_file()


def expand_user(source: str | Path | None) -> str | Path | None:
    """``source`` with a leading ``~`` expanded to the user's home folder (transformers would take ``~/models/x``
    for a malformed hub id); anything else as it is."""
    if isinstance(source, Path) or (isinstance(source, str) and source.startswith("~")):
        return type(source)(os.path.expanduser(source))
    return source


def is_local_path(source: str | Path) -> bool:
    """Whether ``source`` names a local path: a ``Path``, an existing path, text starting with ``.``, ``/`` or
    ``~``, or text with a path separator that is no hub id (``ckpts/run3/draft``); anything else is a hub id or a
    pair name."""
    text = str(source)
    return (
        isinstance(source, Path)
        or Path(text).expanduser().exists()
        or text.startswith((".", "/", "~"))
        or (os.sep in text and not HUB_ID.fullmatch(text))
    )


def check_model_source(source: str | Path, role: str) -> None:
    """Refuse a model name that is neither a path, a pair name nor a hub id, before anything is downloaded.

    A path (anything with a path separator, or starting with ``.`` or ``~``) is left to the loader, which says
    when it does not exist; ``owner/name`` goes to the hub; a bare word (``testbed-huge``, a typo) is an unknown
    name, reported with the valid pair names and the closest one.

    Raises:
        ValueError: naming the input, the valid names and what to do.
    """
    text = str(source)
    if is_pair_name(text) or HUB_ID.fullmatch(text) or is_local_path(source):
        return
    hint = did_you_mean(_split(text)[0], PAIR_NAMES)
    raise InvalidInputError(
        f"{role} {text!r} is not an existing folder, a pair name ({', '.join(PAIR_NAMES)}, optionally ':<family>' "
        f"and '@<calibration>') or a hub id ('owner/name'){hint}"
    )


def resolve_pair(
    target: str | Path | None, draft: str | Path | None = None, family: str | None = None
) -> ResolvedPair:
    """Folders for ``target``/``draft``, building a named pair first when ``target`` names one.

    Args:
        target: a folder, a hub id, a pair name (``testbed-base[:family][@calibration]``,
            ``testbed-mini[...]``, ``tiny[...]``), a saved pipeline's folder, or ``None`` for the default pair.
        draft: a folder or hub id; with a pair name it replaces the pair's own draft; ``"edd"`` with a testbed
            pair name: the EDD draft trained for that target (:mod:`vlmspec.models.edd`), shipped with the package.
        family: the family of a pair name that names none (``testbed-base@cpu``); default :data:`DEFAULT_FAMILY`.
            Every entry point (the API, ``vlmspec demo``/``bench``/``caption``, lmms-eval) resolves through here.

    Returns:
        The :class:`ResolvedPair`.

    Raises:
        ValueError: an unknown name (:func:`check_model_source`), an unknown family or calibration in a pair
            name, or a bad ``VLMSPEC_DEFAULT_PAIR``.
    """
    target, draft = expand_user(target), expand_user(draft)
    if target is None:
        target = os.environ.get(ENV_DEFAULT_PAIR) or DEFAULT_PAIR
        if not is_pair_name(target):
            raise InvalidInputError(
                f"{ENV_DEFAULT_PAIR}={target!r} is not a pair name; use one of {', '.join(PAIR_NAMES)} "
                "(optionally ':<family>'), or name the target explicitly"
            )
    named_edd = draft is not None and str(draft) == EDD_DRAFT and not Path(EDD_DRAFT).exists()
    if draft is not None and not named_edd:
        check_model_source(draft, "draft")
    if named_edd and not is_pair_name(target):
        raise InvalidInputError(
            f"draft={EDD_DRAFT!r} names the EDD draft shipped with a testbed target, but target {str(target)!r} is "
            "not one; train an EDD draft for it (`vlmspec edd train --target ... --out DIR`) and pass draft=DIR"
        )
    if is_pipeline_folder(target):  # written by pipe.save_pretrained: its target/ and draft/ folders
        saved = Path(str(target)).expanduser()
        draft = draft if draft is not None else (saved / "draft" if (saved / "draft").is_dir() else None)
        return ResolvedPair(
            str(saved / "target"), str(draft) if draft is not None else None, f"pipeline:{saved}"
        )
    if not is_pair_name(target):
        check_model_source(target, "target")
        return ResolvedPair(str(target), str(draft) if draft is not None else None, "explicit")
    return _resolve_name(str(target), draft, family, named_edd)


def _resolve_name(target: str, draft: str | Path | None, family: str | None, named_edd: bool) -> ResolvedPair:
    """:func:`resolve_pair` for a pair name (``testbed-*`` or ``tiny``, with its family and calibration)."""
    name, named_family = _split(str(target))
    family = named_family if ":" in split_calibration(str(target))[0] or family is None else family
    calibration = split_calibration(str(target))[1]
    if calibration is not None:
        from .testbed.calibrate import get_calibration

        try:
            get_calibration(calibration)
        except ValueError as err:
            raise InvalidInputError(f"target {target!r}: {err}") from None
    if name == "tiny" and named_edd:
        raise InvalidInputError(
            f"draft={EDD_DRAFT!r}: no EDD draft ships with the random tiny pairs; use a testbed target, or train one"
        )
    if name == "tiny":
        from .testing import TINY_FAMILIES, build_tiny_pair

        if family not in TINY_FAMILIES:
            raise InvalidInputError(
                f"target {target!r}: unknown family {family!r}; valid: {', '.join(TINY_FAMILIES)}"
            )
        pair = build_tiny_pair(family)
        pair_target, pair_draft, source = pair.target, pair.draft, f"tiny:{family}"
    else:
        from . import testbed

        size = name.split("-", 1)[1]
        if family not in testbed.FAMILIES:
            raise InvalidInputError(
                f"target {target!r}: the testbed has no {family!r} pair; valid: {', '.join(testbed.FAMILIES)}"
            )
        pair_target, pair_draft = testbed.pair_paths(size=size, family=family)
        source = f"testbed:{size}:{family}"
        if named_edd:
            draft = testbed.edd_path(size=size, family=family)
    if calibration is not None:
        source += f"@{calibration}"
    return ResolvedPair(
        str(pair_target), str(draft) if draft is not None else str(pair_draft), source, calibration
    )
