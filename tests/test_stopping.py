"""Stop conditions (vlmspec.stopping) on their own: where a stop string ends generation, and ``until_eos``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmspec.stopping import StopCriteria, until_eos


class _CharTokenizer:
    """One token per character (its code point): a stop string ends inside the last token's text exactly when the
    decoded text ends with it."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _stop_at(criteria: StopCriteria, reply: list[int]) -> int | None:
    """The number of reply tokens after which ``criteria`` stops (``None``: never)."""
    return next((i for i in range(1, len(reply) + 1) if criteria.update(reply[:i])), None)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.text(alphabet="abx", min_size=1, max_size=8),
    reply=st.text(alphabet="abx", min_size=1, max_size=8),
    stop=st.text(alphabet="abx", min_size=1, max_size=3),
)
def test_a_stop_string_stops_where_the_text_first_ends_with_it_after_the_prompt(prompt, reply, stop):
    """generate()'s StopStringCriteria decodes prompt and reply together and stops when a stop string ends inside
    the last token: an occurrence that ends in the prompt does not count, one that begins in it does, and an
    earlier occurrence in the window (the prompt's own) must not hide the one the last token completes."""
    criteria = StopCriteria(100, stop_strings=stop, tokenizer=_CharTokenizer()).after_prompt(
        torch.tensor(_ids(prompt))
    )
    expected = next(
        (i for i in range(1, len(reply) + 1) if (prompt + reply[:i]).endswith(stop)),
        None,
    )
    assert _stop_at(criteria, _ids(reply)) == expected


def test_a_prompt_ending_with_the_stop_string_does_not_stop_the_reply_until_it_says_it_again():
    criteria = StopCriteria(100, stop_strings=["ab"], tokenizer=_CharTokenizer()).after_prompt(
        torch.tensor(_ids("Say ab"))
    )
    assert not criteria.update(_ids("a"))  # " ab" + "a": the only "ab" ended in the prompt
    assert criteria.update(_ids("ab"))  # "abab": the reply's own "ab" ends in its last token


def test_until_eos_keeps_the_first_eos_and_drops_what_follows():
    assert until_eos([5, 7, 2, 9, 2], (2,)) == [5, 7, 2]
    assert until_eos([5, 3, 7, 2], (2, 3)) == [5, 3]  # any of several EOS ids, the first one met
    assert until_eos([2], (2,)) == [2]
    assert until_eos([5, 7], (2,)) == [5, 7]  # no EOS: everything
    assert until_eos([5, 7], ()) == [5, 7]
