"""The argparse types of the bench's flags: comma lists, batch sizes, ``auto`` words (JSON objects are
:func:`vlmspec.cli.json_object`); each error names the flag and what it takes (the parser is
:class:`vlmspec.cli.ArgumentParser`: a bad flag is one line, exit status 1)."""

from __future__ import annotations

import argparse

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
