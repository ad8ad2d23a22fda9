"""The argparse types of the bench's flags: comma lists, positive integers, ``auto`` words, JSON objects; each error
names the flag and what it takes (the parser is :class:`vlmspec.cli.ArgumentParser`: a bad flag is one line, exit
status 1)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from vlmspec.cli import positive_int


def comma_list(kind: type):
    """An argparse ``type``: comma-separated ``kind`` values as a tuple (``""``/``none``: empty)."""

    def parse(text: str) -> tuple:
        if text.strip().lower() in ("", "none"):
            return ()
        try:
            return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__}s, got {text!r}"
            ) from err

    return parse


def batch_sizes(flag: str):
    """An argparse ``type``: comma-separated batch sizes (integers >= 1, at least one, each once) as a tuple."""

    def parse(text: str) -> tuple[int, ...]:
        sizes = tuple(
            positive_int(part.strip(), flag, " batch size") for part in text.split(",") if part.strip()
        )
        if not sizes:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated batch sizes >= 1, e.g. 1,4,8")
        twice = sorted({size for size in sizes if sizes.count(size) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{flag} gives batch size(s) {twice} more than once in {text!r}")
        return sizes

    return parse


def budget(text: str) -> int | str | None:
    if text in ("auto", "default"):
        return None if text == "default" else text
    return positive_int(text, "--budget", ", 'auto' or 'default'")


def beam_width(text: str) -> int | None:
    return None if text == "auto" else positive_int(text, "--beam-width", " or 'auto'")


def json_object(flag: str, example: str) -> Callable[[str], dict[str, Any]]:
    """An argparse ``type``: a JSON object, else an error naming ``flag`` with ``example``."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a JSON object, e.g. '{example}', got {text!r} ({err.msg})"
            ) from err
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {text!r}")
        return value

    return parse
