"""The native prefix index (native/prefix_index) against the Python one it replaces: the
same random operations give the same answers, and block hashes are the same values."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from infergate.epp.scheduling import prefix_index
from infergate.epp.scheduling.plugins import prefix
from infergate.epp.scheduling.prefix_index import PythonPrefixIndex, python_block_hashes
from infergate.epp.types import InferenceRequest

native = pytest.importorskip("infergate.epp.scheduling._prefix_index")


def test_the_native_index_is_built_and_used() -> None:
    """``make install`` builds it; without it the scorer falls back to Python (with a
    warning: tests/epp/test_native.py)."""
    assert prefix_index.PrefixIndex is native.PrefixIndex
    assert prefix_index.native is native
    assert prefix.PrefixIndex is native.PrefixIndex  # the scorer's index


@settings(max_examples=200, deadline=None)
@given(
    seed=st.binary(max_size=40),
    data=st.binary(max_size=700),
    block_chars=st.integers(1, 80),
    max_blocks=st.integers(0, 12),
)
def test_block_hashes_are_the_python_values(
    seed: bytes, data: bytes, block_chars: int, max_blocks: int
) -> None:
    expected = python_block_hashes(seed, data, block_chars, max_blocks)
    if len(data) < block_chars:
        expected = b""
    assert native.block_hashes(seed, data, block_chars, max_blocks) == expected


def test_block_hashes_of_a_prompt_shorter_than_a_block_are_empty() -> None:
    assert prefix_index.block_hashes("m", "", b"abc", 64, 256) == []
    assert prefix_index.block_hashes("m", "", b"abc", 0, 256) == []


def _operations(rng: random.Random, steps: int) -> list[tuple[str, tuple[object, ...]]]:
    """Random calls over few servers and few hashes, so entries collide, get evicted,
    refreshed, dropped and cleared."""
    servers = ["a", "b", "c", "d"]
    ops: list[tuple[str, tuple[object, ...]]] = []
    for _ in range(steps):
        server = rng.choice(servers)
        ints = [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
        # Half the calls pass them packed, as the scorer does (block_hashes' bytes).
        hashes: object = struct.pack(f"<{len(ints)}Q", *ints) if rng.random() < 0.5 else ints
        kind = rng.choices(
            ["add", "match", "set_capacity", "drop_older_than", "remove", "clear_server",
             "last_uses", "last_use", "size", "capacity_of", "servers"],
            weights=[30, 20, 6, 5, 5, 2, 8, 4, 4, 4, 2],
        )[0]  # fmt: skip
        if kind == "add":
            ops.append((kind, (server, hashes)))
        elif kind == "match":
            ops.append((kind, (hashes,)))
        elif kind == "set_capacity":
            ops.append((kind, (server, rng.randrange(-2, 15))))
        elif kind == "drop_older_than":
            ops.append((kind, (server, rng.randrange(0, 400))))
        elif kind in ("remove", "last_uses"):
            ops.append((kind, (server, hashes)))
        elif kind == "last_use":
            ops.append((kind, (server, rng.randrange(40))))
        elif kind == "servers":
            ops.append((kind, ()))
        else:
            ops.append((kind, (server,)))
    return ops


@pytest.mark.parametrize("seed", range(20))
def test_the_native_index_answers_as_the_python_one(seed: int) -> None:
    rng = random.Random(seed)
    python, rust = PythonPrefixIndex(8), native.PrefixIndex(8)
    for step, (name, args) in enumerate(_operations(rng, 400)):
        want = getattr(python, name)(*args)
        got = getattr(rust, name)(*args)
        if name == "servers":
            want, got = sorted(want), sorted(got)
        assert got == want, f"step {step}: {name}{args}"


@pytest.mark.parametrize("make", [PythonPrefixIndex, native.PrefixIndex])
def test_packed_hashes_must_be_whole_u64s(make: type) -> None:
    """Packed hashes of a length that is not a multiple of 8 are a caller's bug: both
    indexes refuse them, naming the length, and change nothing."""
    index = make(4)
    for method, args in (("add", ("a",)), ("match", ()), ("last_uses", ("a",))):
        with pytest.raises(ValueError, match="whole little-endian u64s; got 9 bytes"):
            getattr(index, method)(*args, b"\x01" * 9)
    assert index.size("a") == 0
    index.add("a", struct.pack("<2Q", 7, 8))
    assert index.match([7, 8]) == index.match(struct.pack("<2Q", 7, 8)) == {"a": 2}


def test_the_native_index_refuses_hashes_that_are_not_64_bit() -> None:
    """Hashes come from xxh64 (this index or other replicas' headers, decoded unsigned);
    anything else is a caller's bug and raises rather than being folded."""
    index = native.PrefixIndex(4)
    with pytest.raises(OverflowError):
        index.add("a", [-1])
    with pytest.raises(OverflowError):
        index.add("a", [1 << 64])
    with pytest.raises(TypeError):
        index.add("a", "abc")
    assert index.size("a") == 0


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300), limit=st.integers(-2, 400), chat=st.booleans())
def test_prompt_head_is_the_head_of_prompt_bytes(text: str, limit: int, chat: bool) -> None:
    """The scorer hashes ``prompt_head``; it must be the bytes ``prompt_bytes`` gives, lone
    surrogates and all, whether or not the prompt is ASCII."""
    request = InferenceRequest(request_id="r", headers={})
    if chat:
        request.body = {"messages": [{"role": "user", "content": text}]}
    else:
        request.prompt_text = text
    whole = prefix.prompt_bytes(request)
    assert prefix.prompt_head(request, limit) == (whole[: max(0, limit)], len(whole))
