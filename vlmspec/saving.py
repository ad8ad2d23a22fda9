"""A pipeline saved to a folder and loaded back: the pair, and the settings a user chose.

``pipe.save_pretrained(folder)`` writes::

    folder/
      target/                  the target (save_pretrained) and its processor
      draft/                   the draft (with the target's tokenizer; an EDD draft in its own format)
      vlmspec_pipeline.yaml    the policy, the options the user set, the pruning, and where they are set, the
                               processor settings (``mm_processor_kwargs``) and the reasoning parser
      policy_files/            copies of the files the policy's options name (C2T's ``classifier``), if any

Policy options that name a file (:attr:`~vlmspec.policies.PolicyConfig.file_fields`) are saved as copies of the
file and its companions (C2T's JSON feature spec) under ``policy_files/<option>/``, recorded relative to the folder
and read back against it, so the folder is self-contained: it loads from anywhere, moved or copied, without the
original files.

``VLMSpecPipeline.from_pretrained(folder)`` and ``vlmspec demo --target folder`` load it back; every other entry
point that takes a target (``bench``, ``caption``, lmms-eval's ``target=``) takes its pair. Options the user left to the machine (node budget,
depth, PCT's cost ratio, SAGE's node and level prices) are not saved: they are fitted again, by the cost probe, on the machine that loads it.
"""

from __future__ import annotations

import dataclasses
import numbers
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from .errors import InputNotFoundError, InvalidInputError, VLMSpecError
from .models import EDDDraft
from .named_pairs import PIPELINE_FILE, is_pipeline_folder
from .policies import TreePolicy, get_policy, policy_class
from .processor_settings import check_settings_form
from .pruning import PruningConfig
from .quantization import check_savable
from .reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser

REQUEST_SETTINGS = ("mm_processor_kwargs", "reasoning_parser")
"""The pipeline's settings for every request that a save keeps (set as attributes of the pipeline)."""
SETTINGS = ("policy", "policy_options", "pruning", *REQUEST_SETTINGS)
POLICY_FILES = "policy_files"
"""The folder of a saved pipeline holding copies of the files its policy options name."""
_PARTS = ("target", "draft", POLICY_FILES, PIPELINE_FILE)
"""What a save writes into its folder (anything else there is the user's, kept when the save is replaced)."""


def save_pipeline(pipe: Any, folder: str | Path) -> Path:
    """Write ``pipe``'s pair and settings into ``folder`` (see the module docstring); returns the folder.

    A folder that holds an earlier save is replaced (files of the user's own there are kept); any other non-empty
    folder is refused. Everything is written into a staging folder inside ``folder`` first and its parts are swapped
    in at the end by renames within ``folder``, so a failure while writing (a full disk, a bad file) leaves an
    earlier save as it was, and ``folder`` itself is never moved (it may be the working directory or a mount point).

    Raises:
        ValueError: ``folder`` is a file or lies under one, or exists, is not empty and is not a saved pipeline.
        FileNotFoundError: a file a policy option names no longer exists.
    """
    folder = Path(folder).expanduser()
    options, copies = _policy_files(pipe.policy)
    values = {
        "policy": pipe.policy.name,
        "policy_options": options,
        "pruning": dataclasses.asdict(pipe.pruning),
        "mm_processor_kwargs": pipe.mm_processor_kwargs,
        "reasoning_parser": _parser_setting(pipe.reasoning_parser),
    }
    try:  # first, so that a value YAML cannot hold fails before anything is written
        settings = yaml.safe_dump(
            _plain({k: v for k, v in values.items() if v or k not in REQUEST_SETTINGS}), sort_keys=False
        )
    except yaml.YAMLError as err:
        raise InvalidInputError(
            f"cannot save the pipeline's settings {values!r:.200}: YAML cannot hold a value among them ({err}); "
            "use plain numbers, strings, lists and dicts"
        ) from None
    for role, model in (("target", pipe.target), ("draft", pipe.draft)):
        check_savable(model, role)  # before anything is written
    _check_folder(folder)
    real = folder.resolve()  # a linked folder is written where it points
    real.mkdir(parents=True, exist_ok=True)
    staging = real / f"{_STAGING}{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        for source, saved in copies:  # from the earlier save itself, maybe: it stays until the swap
            (staging / saved).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staging / saved)
        pipe.target.save_pretrained(staging / "target")
        pipe.processor.save_pretrained(staging / "target")
        if pipe.draft is not None:
            pipe.draft.save_pretrained(staging / "draft")
            if not isinstance(pipe.draft, EDDDraft):  # the pair passed the vocabulary check: tokenizers agree
                pipe.tokenizer.save_pretrained(staging / "draft")
        (staging / PIPELINE_FILE).write_text(settings)
        _swap_in(staging, real)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


_STAGING = ".vlmspec-saving-"
"""Name prefix of the staging folder a save writes inside its folder (and of the earlier save's parts it moves
aside); one left by a save that was killed is removed by the next."""


def _swap_in(staging: Path, folder: Path) -> None:
    """Put the parts of the finished save ``staging`` (inside ``folder``) in place of an earlier save's: the
    earlier parts are moved aside into ``staging``'s ``.replaced``, the new ones renamed into ``folder``, and on a
    failure the earlier ones are moved back. The user's own files in ``folder`` are not touched."""
    aside = staging / ".replaced"
    aside.mkdir()
    moved, placed = [], []
    try:
        for part in _PARTS:
            if (folder / part).exists():
                (folder / part).rename(aside / part)
                moved.append(part)
        for part in _PARTS:
            if (staging / part).exists():
                (staging / part).rename(folder / part)
                placed.append(part)
    except OSError:
        for part in placed:
            _remove(folder / part)
        for part in moved:  # the earlier save back in place
            (aside / part).rename(folder / part)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def read_settings(folder: str | Path) -> dict[str, Any]:
    """The settings of a saved pipeline: ``policy`` (a name), ``policy_options`` (a dict), ``pruning`` (a
    :class:`~vlmspec.pruning.PruningConfig`), ``mm_processor_kwargs`` (a dict, checked against the processor when
    the pipeline is built) and ``reasoning_parser`` (a name, a :class:`~vlmspec.reasoning.ReasoningParser` or
    ``None``). A file saved before the last two were saved reads them as none set.

    Raises:
        ValueError: the file is not YAML, not a mapping, has unknown keys or values of the wrong kind (named).
    """
    folder = Path(folder).expanduser()
    file = folder / PIPELINE_FILE
    where = f"saved pipeline settings {str(file)!r}"
    try:
        values = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise InvalidInputError(f"{where} could not be read as YAML: {err}") from err
    if not isinstance(values, dict) or set(values) - set(SETTINGS):
        raise InvalidInputError(
            f"{where} must be a mapping with the keys {', '.join(SETTINGS)}, got {values!r:.120}"
        )
    policy, options, pruning, processing, parser = (values.get(key) for key in SETTINGS)
    if (
        not isinstance(policy, str)
        or not all(value is None or isinstance(value, dict) for value in (options, pruning, processing))
        or not isinstance(parser, (str, dict, type(None)))
    ):
        raise InvalidInputError(
            f"{where}: policy must be a name, policy_options, pruning and mm_processor_kwargs mappings, "
            f"reasoning_parser a name or a mapping; got {values!r:.160}"
        )
    try:
        pruning_config = PruningConfig(**(pruning or {}))
    except TypeError as err:
        raise InvalidInputError(f"{where}: pruning: {err}") from None
    try:
        parser = ReasoningParser(**parser) if isinstance(parser, dict) else parser
    except (TypeError, VLMSpecError) as err:
        raise InvalidInputError(f"{where}: reasoning_parser: {err}") from None
    options = _files_in_folder(folder, policy, dict(options or {}))
    return {
        "policy": policy,
        "policy_options": options,
        "pruning": pruning_config,
        "mm_processor_kwargs": dict(processing or {}),
        "reasoning_parser": parser,
    }


def check_request_settings(folder: Any, settings: dict[str, Any], given: dict[str, Any]) -> None:
    """What can be checked of the :data:`REQUEST_SETTINGS` :func:`restore_settings` will set before any model
    loads: the processor settings' form (:func:`~vlmspec.processor_settings.check_settings_form`) and the reasoning
    parser's name.

    Raises:
        VLMSpecError: naming the argument, or the settings file and key of a saved one.
    """
    for name, value, where in _chosen_settings(folder, settings, given):
        if name == "mm_processor_kwargs":
            check_settings_form(value, f"{where}: {name}" if where else name)
            continue
        try:
            reasoning_parser(value)
        except VLMSpecError as err:
            raise _saved(err, where) from None


def restore_settings(pipe: Any, folder: Any, settings: dict[str, Any], given: dict[str, Any]) -> None:
    """Set ``pipe``'s :data:`REQUEST_SETTINGS` (``mm_processor_kwargs``, ``reasoning_parser``): those ``given``
    (not ``None``), else those of a saved pipeline's ``settings`` (:func:`read_settings` of ``folder``; ``{}`` for
    any other source). ``reasoning_parser=None`` leaves a saved parser in place (``"none"`` drops it);
    ``mm_processor_kwargs={}`` drops saved processor settings.

    Raises:
        VLMSpecError: a setting the pipeline refuses, naming the argument, or the settings file and key.
    """
    for name, value, where in _chosen_settings(folder, settings, given):
        if name == "mm_processor_kwargs":
            pipe.mm_processor_kwargs = pipe.check_mm_processor_kwargs(
                value, f"{where}: {name}" if where else name
            )
            continue
        try:
            pipe.reasoning_parser = value
        except VLMSpecError as err:
            raise _saved(err, where) from None


def _chosen_settings(
    folder: Any, settings: dict[str, Any], given: dict[str, Any]
) -> Iterator[tuple[str, Any, str]]:
    """``(name, value, where)`` of each request setting: the one given (``where`` empty), else the saved one
    (``where`` names the settings file)."""
    where = f"saved pipeline settings {str(Path(str(folder)).expanduser() / PIPELINE_FILE)!r}"
    for name in REQUEST_SETTINGS:
        if given.get(name) is not None:
            yield name, given[name], ""
        else:
            yield name, settings.get(name), where


def _saved(err: VLMSpecError, where: str) -> VLMSpecError:
    """``err``, its message prefixed with ``where`` (the settings file) when the setting was saved there."""
    return type(err)(f"{where}: {err}") if where else err


def _parser_setting(parser: ReasoningParser | None) -> str | dict[str, str] | None:
    """A reasoning parser as saved: its name when it is one of :data:`~vlmspec.reasoning.REASONING_PARSERS`, else
    its tags (a parser of the user's own)."""
    if parser is None or REASONING_PARSERS.get(parser.name) == parser:
        return None if parser is None else parser.name
    return dataclasses.asdict(parser)


def saved_policy(folder: str | Path, settings: dict[str, Any], options: dict[str, Any]) -> TreePolicy:
    """The policy of a saved pipeline's ``settings`` (:func:`read_settings` of ``folder``), with the caller's policy
    ``options`` on top of the saved ones.

    Raises:
        VLMSpecError: the saved policy settings are invalid, or ``options`` conflict with them; the message names
            the settings file (and the options given, when they are the cause).
    """
    where = f"saved pipeline settings {str(Path(folder).expanduser() / PIPELINE_FILE)!r}"
    name, own = settings["policy"], settings["policy_options"]
    try:
        return get_policy(name, **{**own, **options})
    except VLMSpecError as err:
        try:
            get_policy(name, **own)
        except VLMSpecError:
            raise type(err)(f"{where}: policy {name!r} with policy_options {own}: {err}") from None
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise type(err)(
            f"the policy options given ({given}) on top of the saved ones of {where} (policy {name!r} with "
            f"policy_options {own}): {err}"
        ) from None


def _check_folder(folder: Path) -> None:
    """Refuse to save into ``folder`` when it is a file or lies under one, or holds other things than a saved
    pipeline.

    Raises:
        ValueError: naming the folder, what is wrong and what to do.
    """
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        what = "it is an existing file" if existing == folder else f"{str(existing)!r} on its path is a file"
        raise InvalidInputError(
            f"cannot save the pipeline into {str(folder)!r}: {what}, not a folder; save into a new or empty folder"
        )
    for leftover in folder.glob(f"{_STAGING}*") if existing == folder else ():  # a killed save's
        shutil.rmtree(leftover, ignore_errors=True)
    if existing == folder and any(folder.iterdir()) and not is_pipeline_folder(folder):
        raise InvalidInputError(
            f"{str(folder)!r} is not empty and holds no saved pipeline; save into a new or empty folder"
        )


def _policy_files(policy: TreePolicy) -> tuple[dict[str, Any], list[tuple[Path, PurePosixPath]]]:
    """The options the user set on ``policy``, each file option as its copy's path in the saved folder
    (``policy_files/<option>/<name>``), and the copies to make: (file, path in the folder), companions included.

    Raises:
        FileNotFoundError: a file an option names, or one of its companions, no longer exists.
    """
    config = type(policy.config)
    options, copies = dict(policy.requested), []
    for field in config.file_fields:
        if options.get(field) is None:
            continue
        source = Path(options[field])
        saved = PurePosixPath(POLICY_FILES, field, source.name)
        options[field] = str(saved)
        for file in (source, *config.companion_files(field, source)):
            if not file.is_file():
                raise InputNotFoundError(
                    f"cannot save policy {policy.name!r}: its option {field}={str(source)!r} needs {str(file)!r}, "
                    "which does not exist (a relative path is read from the working directory); put the file "
                    "back, or set the option to an existing file, and save again"
                )
            copies.append((file, saved.parent / file.name))
    return options, copies


def _files_in_folder(folder: Path, policy: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each file option of ``policy`` (:attr:`~vlmspec.policies.PolicyConfig.file_fields`) read
    against ``folder``, where :func:`save_pipeline` copied its file (an absolute path stays as it is; an unknown
    policy's options are left for ``get_policy`` to refuse by name)."""
    try:
        fields = policy_class(policy).config_class.file_fields
    except InvalidInputError:
        return options
    return {
        name: str(folder.absolute() / value) if name in fields and isinstance(value, str) else value
        for name, value in options.items()
    }


def _plain(value: Any) -> Any:
    """Tuples as lists, numbers and numpy's values (scalars, arrays) as Python's, recursively: what
    ``yaml.safe_dump`` writes and the configs read back."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # numpy's scalars and arrays
        return _plain(value.tolist())
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value
