"""Property-based tests: random option values, frames and output files give a valid result or the library's own
error (a ``VLMSpecError``) naming the input; never a crash, and never a changed file the caption job did not write."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vlmspec.errors import VLMSpecError
from vlmspec.inputs import load_video
from vlmspec.policies import available_policies, get_policy, policy_class

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

VALUES = st.one_of(
    st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
    st.lists(
        st.one_of(st.integers(-1, 5), st.lists(st.integers(-1, 5), max_size=3), st.text(max_size=2)),
        max_size=3,
    ),
)


@st.composite
def policy_options(draw):
    name = draw(st.sampled_from([p for p in available_policies() if p != "c2t"]))  # c2t loads a file
    fields = [f.name for f in dataclasses.fields(policy_class(name).config_class)]
    chosen = draw(st.lists(st.sampled_from([*fields, "not_an_option"]), max_size=3, unique=True))
    return name, {field: draw(VALUES) for field in chosen}


@FAST
@given(policy_options())
def test_random_policy_options_give_a_policy_or_a_named_error(case):
    name, options = case
    config = policy_class(name).config_class.__name__
    try:
        policy = get_policy(name, **options)
    except VLMSpecError as err:
        assert config in str(err), str(err)  # the message names the config (and the option)
    else:
        assert policy.config == policy.config_class.from_dict(policy.config.to_dict())


@FAST
@given(
    st.sampled_from([("static", "paths"), ("sage", "initial_paths"), ("sage_paper", "initial_paths")]), VALUES
)
def test_random_rank_paths_give_a_tree_or_a_named_error(field, value):
    name, option = field
    try:
        policy = get_policy(name, **{option: value})
    except VLMSpecError as err:
        assert f"{policy_class(name).config_class.__name__}.{option}=" in str(err), str(err)
    else:
        assert all(
            isinstance(p, tuple) and all(isinstance(r, int) for r in p)
            for p in getattr(policy.config, option)
        )


FRAMES = st.tuples(
    st.sampled_from([np.uint8, np.int16, np.int64, np.float32, np.float64, np.bool_]),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(2, 4),
    st.one_of(st.floats(-2, 300), st.just(float("nan")), st.just(float("inf"))),
)


@FAST
@given(st.lists(FRAMES, min_size=1, max_size=3))
def test_random_frames_are_read_or_refused_by_name(specs):
    frames = [np.full((h, w, c), v).astype(dtype) if np.isfinite(v) or dtype in (np.float32, np.float64)
              else np.zeros((h, w, c), dtype) for dtype, h, w, c, v in specs]  # fmt: skip
    try:
        images, metadata = load_video(frames)
    except VLMSpecError as err:
        assert "video frame" in str(err), str(err)
    else:
        assert len(images) == metadata.total_num_frames == len(frames)
        assert all(im.mode == "RGB" and im.size == images[0].size for im in images)


@pytest.fixture(scope="module")
def job():
    import vlmspec_caption

    return vlmspec_caption


PIECES = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"\n", b'{"id": "a", "caption": "x"}\n', b'{"id": "b"', b"notes\n", b"{}\n"]),
)


@FAST
@given(st.lists(PIECES, max_size=5))
@example([b'{"id": "a", "caption": "x"}\n', b"\x00"])  # the zero bytes a crash can leave after a record
def test_random_output_files_are_read_or_refused_and_only_a_torn_record_is_cut(job, tmp_path, pieces):
    out = tmp_path / "out.jsonl"
    data = b"".join(pieces)
    out.write_bytes(data)
    try:
        records = job.read_output(out, repair=True)
    except job.JobError as err:
        assert isinstance(err, VLMSpecError)
        assert str(out) in str(err) and out.read_bytes() == data  # refused: not a byte changed
        return
    after = out.read_bytes()
    assert data.startswith(after)  # at most a tail was cut ...
    cut = data[len(after) :]
    torn = cut.lstrip(b"\n").rstrip(b"\0")  # ... a torn record: its first bytes, or the zero bytes of a crash
    assert not cut.strip() or torn.startswith(job.RECORD_START) or job.RECORD_START.startswith(torn)
    assert all(isinstance(r, dict) and "id" in r for r in records)
