"""The Responses API store's bounds: at most ``max_entries``, each kept ``ttl_s`` after
its last write (a fake clock makes the TTL exact)."""

from __future__ import annotations

import pytest
from infergate.engine.entrypoints.response_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(text: str = "") -> StoredResponse:
    return StoredResponse("tiny", {"status": "completed", "output": [text]}, [])


def test_oldest_goes_first_past_the_bound() -> None:
    store = ResponseStore(max_entries=2, ttl_s=60, clock=Clock())
    for rid in ("a", "b", "c"):
        store.put(rid, _entry(rid))
    assert store.get("a") is None and len(store) == 2
    store.put("b", _entry("b2"))  # a rewrite makes it the newest
    store.put("d", _entry())
    assert store.get("c") is None
    held = store.get("b")
    assert held is not None and held.response["output"] == ["b2"]


def test_entries_expire_ttl_after_their_last_write() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=5, clock=clock)
    store.put("a", _entry())
    clock.now = 3
    store.put("b", _entry())
    clock.now = 4.9
    assert store.get("a") is not None
    clock.now = 5
    assert store.get("a") is None and store.get("b") is not None
    store.put("b", _entry())  # refreshed at 5: kept until 10
    clock.now = 9.9
    assert store.get("b") is not None
    clock.now = 10
    assert store.get("b") is None and len(store) == 0


def test_conversation_is_input_then_output() -> None:
    entry = StoredResponse("tiny", {"output": [{"type": "message"}]}, [{"role": "user"}])
    assert entry.conversation() == [{"role": "user"}, {"type": "message"}]


@pytest.mark.parametrize(("max_entries", "ttl_s"), [(0, 5), (1, 0)])
def test_bounds_must_be_positive(max_entries: int, ttl_s: float) -> None:
    with pytest.raises(ValueError):
        ResponseStore(max_entries, ttl_s)
