"""compact_json writes what ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)``
writes for the values a request body holds, so prefix keys and rewritten bodies keep
their bytes; and it never raises where the standard library would not."""

from __future__ import annotations

import json
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from infergate.epp.compact_json import compact_json


def _stdlib(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")


def test_every_code_point_in_a_string_is_written_as_the_standard_library_writes_it() -> None:
    surrogates = range(0xD800, 0xE000)  # lone ones cannot reach here: see the next test
    points = [cp for cp in range(sys.maxunicode + 1) if cp not in surrogates]
    for start in range(0, len(points), 4096):
        text = "".join(chr(cp) for cp in points[start : start + 4096])
        value = [{"role": "user", "content": f'a"\\{text}b'}]
        assert compact_json(value) == _stdlib(value), hex(points[start])


def test_lone_surrogates_and_huge_integers_fall_back_instead_of_raising() -> None:
    value = {"content": "x\ud800y", "n": 1 << 80}
    assert compact_json(value) == _stdlib(value)
    assert b"x?y" in compact_json(value)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_body_shaped_values_match_the_standard_library(value: Any) -> None:
    """Floats aside (exponents are spelt ``1e16``, not ``1e+16``), the bytes are equal."""
    assert compact_json(value) == _stdlib(value)
