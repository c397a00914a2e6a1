"""Gateway API hostname semantics (wildcards, intersection, precedence)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infergate.gateway import hostnames as h

LABELS = st.sampled_from(["a", "b", "example", "com"])
HOSTS = st.builds(
    lambda wild, labels: ("*." if wild else "") + ".".join(labels),
    st.booleans(),
    st.lists(LABELS, min_size=1, max_size=4),
) | st.just(h.ANY)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("example.com", True),
        ("*.example.com", True),
        ("a-b.c", True),
        ("10.0.0.1", False),
        ("*.10.0.0.1", False),
        ("Example.com", False),
        ("a..b", False),
        ("*", False),
        ("a.*.b", False),
        ("", False),
        ("-a.b", False),
    ],
)
def test_valid(name: str, ok: bool) -> None:
    assert h.valid(name) is ok


def test_wildcards_match_one_or_more_labels() -> None:
    assert h.covers("*.example.com", "a.example.com")
    assert h.covers("*.example.com", "a.b.example.com")
    assert h.covers("*.example.com", "*.a.example.com")
    assert not h.covers("*.example.com", "example.com")
    assert not h.covers("*.a.example.com", "*.example.com")
    assert h.covers(h.ANY, "*.example.com")


def test_intersection_keeps_the_more_specific_side() -> None:
    assert h.effective("*.example.com", ["a.example.com", "a.org"]) == ["a.example.com"]
    assert h.effective("a.example.com", ["*.example.com"]) == ["a.example.com"]
    assert h.effective(h.ANY, []) == [h.ANY]
    assert h.effective("a.example.com", []) == ["a.example.com"]
    assert h.effective("a.example.com", ["b.example.com"]) == []


def test_specificity_orders_exact_wildcard_any() -> None:
    ordered = sorted(
        ["*.example.com", h.ANY, "a.example.com", "*.a.example.com"],
        key=h.specificity,
        reverse=True,
    )
    assert ordered == ["a.example.com", "*.a.example.com", "*.example.com", h.ANY]


@given(HOSTS, HOSTS)
def test_covering_lists_exactly_the_covering_hostnames(pattern: str, host: str) -> None:
    assert h.covers(pattern, host) == (pattern in h.covering(host))


@given(HOSTS, HOSTS)
def test_intersection_is_covered_by_both(a: str, b: str) -> None:
    both = h.intersect(a, b)
    if both is not None:
        assert h.covers(a, both) and h.covers(b, both)
