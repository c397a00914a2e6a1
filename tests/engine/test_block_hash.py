"""The block-hash recipe is deterministic, chained and salted (the EPP relies on it)."""

from __future__ import annotations

import subprocess
import sys

from infergate.wire.block_hash import ROOT_HASH, block_hashes, hash_block


def test_chain_covers_parent_and_only_full_blocks() -> None:
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # the trailing 8 tokens are not a full block
    assert hashes[0] == hash_block(None, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    # Same tokens under a different parent hash to something else.
    assert hash_block(ROOT_HASH + 1, tokens[16:32]) != hashes[1]


def test_salt_changes_every_block_and_continuation_matches() -> None:
    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert block_hashes(tokens, 16, cache_salt="tenant-b") != salted
    # Continuing a chain from block 2 gives the same tail as hashing all at once.
    assert block_hashes(tokens, 16, parent=plain[1], start_block=2) == plain[2:]


def test_hashes_are_stable_across_processes() -> None:
    code = (
        "from infergate.wire.block_hash import block_hashes;"
        "print(block_hashes(list(range(32)), 16, cache_salt='s'))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    assert runs == {f"{block_hashes(list(range(32)), 16, cache_salt='s')}\n"}
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(32)), 16))
