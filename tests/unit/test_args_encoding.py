"""A batch's args are encoded once per job from a C encoder set up once
(``enqueueing.encode_accepted_args``): the text must be exactly ``ARGS_ENCODER.encode``'s,
or a copied job would differ from the same job inserted one at a time."""

from __future__ import annotations

import json.encoder

from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import enqueueing

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
# Keys JSON turns into strings are accepted too (as ARGS_ENCODER accepts them).
keys = (
    st.text()
    | st.integers()
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False, allow_infinity=False)
)
objects = st.dictionaries(keys, values, max_size=6)


@settings(max_examples=400, deadline=None)
@given(objects)
def test_the_once_built_encoder_writes_the_same_text(args):
    assert enqueueing.encode_accepted_args(args) == enqueueing.ARGS_ENCODER.encode(args)


def test_non_ascii_and_escapes_as_the_strict_encoder():
    args = {"name": "Zoë ☃ 𝄞", "q": 'a "quoted"\nline\\', "n": [1.5, 10**20, None, True]}
    text = enqueueing.encode_accepted_args(args)
    assert text == enqueueing.ARGS_ENCODER.encode(args)
    assert text.isascii()


def test_without_the_c_accelerator_it_is_the_strict_encoder(monkeypatch):
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    assert enqueueing._accepted_args_encoder() == enqueueing.ARGS_ENCODER.encode
