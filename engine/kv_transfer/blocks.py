"""The engine-thread side of P/D: hold a finished prefill's blocks; commit pulled ones.

Every method runs on the engine thread (the block pool is not thread-safe); the producer
transport reaches them through :class:`EngineHooks`, which posts calls to that thread.

**Producer** (prefill engine). A request with ``kv_transfer_params.do_remote_decode``
runs as usual (``max_tokens: 1``); when it finishes, its block table is *detached* instead
of freed (:meth:`KVTransfer.hold`) and the response carries ``kv_transfer_params`` naming
the transfer. The blocks go back to the pool — as prefix-cache entries, like any freed
block — when the decode engine has pulled them, when it says it will not, or after
``abort_timeout_s``.

**Consumer** (decode engine). What is transferred is the prompt's leading *full* blocks
that the decode engine would be able to reuse, ``n = ⌊(prompt_tokens − 1) / block_size⌋``
(the last token is always computed locally: its step yields the first token's logits).
:meth:`KVTransfer.inject` checks the payload's block hashes against the request's own
(same tokens, same ``cache_salt``, same hash recipe), keeps the blocks it already has
cached, writes the others into fresh blocks and *commits* them under their hashes — so the
scheduler's ordinary prefix lookup finds the whole transferred prefix, and the engine's
next request with that prompt is a prefix-cache hit. The blocks stay pinned (one extra
reference) until the request is admitted (it then holds its own references), so nothing
evicts them while it waits — unless pins alone keep the queue from moving
(:meth:`KVTransfer.after_schedule`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infergate.engine.core.block_pool import Block
from infergate.engine.core.kv_cache_manager import KVCacheManager
from infergate.engine.core.request import Request
from infergate.engine.kv_transfer.connector import KVPayload

if TYPE_CHECKING:
    from infergate.engine.core.engine_core import EngineCore
    from infergate.engine.core.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class Held:
    blocks: list[Block]  # the whole detached table (freed together)
    hashes: list[int]  # of the leading blocks offered for transfer
    deadline: float


@dataclass
class TransferStats:
    held: int = 0  # prefills held for a decode engine
    pulled: int = 0  # … whose blocks were read for a pull
    released: int = 0  # … freed (pulled, released by the consumer, or expired)
    expired: int = 0  # … freed by the abort timeout
    injected: int = 0  # pulled payloads committed into this engine's pool
    injected_tokens: int = 0
    rejected: int = 0  # payloads that did not fit / did not match (local prefill)


class KVTransfer:
    def __init__(
        self,
        kv: KVCacheManager,
        runner: Any,
        *,
        engine_id: str,
        abort_timeout_s: float,
        modelled_block_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.runner = runner
        self.engine_id = engine_id
        self.abort_timeout_s = abort_timeout_s
        #: Bytes per block a pull stands for when the runner has no KV tensors (simulated).
        self.modelled_block_bytes = modelled_block_bytes
        self.clock = clock
        self.advertise: tuple[str, int] | None = None  # the producer's (host, port)
        self.held: dict[str, Held] = {}
        self.pins: dict[str, list[Block]] = {}
        self.stats = TransferStats()

    @property
    def kv_caches(self) -> Any:
        return getattr(self.runner, "kv_caches", None)

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self.held.values())

    # -- producer --------------------------------------------------------------------
    def hold(self, request: Request) -> dict[str, Any] | None:
        """Detach a finished prefill's blocks; its response's ``kv_transfer_params``."""
        table = self.kv.detach(request)
        if not table:
            return None
        bs = self.kv.block_size
        request.update_block_hashes(bs)
        n = min((request.num_prompt_tokens - 1) // bs, len(request.block_hashes), len(table))
        tid = uuid.uuid4().hex
        self.held[tid] = Held(table, request.block_hashes[:n], self.clock() + self.abort_timeout_s)
        self.stats.held += 1
        host, port = self.advertise or ("", 0)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": [b.block_id for b in table[:n]],
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": tid,
            "tp_size": 1,
        }

    def read(self, transfer_id: str) -> KVPayload | None:
        held = self.held.get(transfer_id)
        if held is None:
            return None
        ids = [b.block_id for b in held.blocks[: len(held.hashes)]]
        payload = KVPayload(transfer_id, self.engine_id, list(held.hashes))
        caches = self.kv_caches
        if caches is not None:
            from infergate.engine.kv_transfer.tensors import read_blocks

            payload.meta, payload.data = read_blocks(caches, ids)
            payload.nbytes = len(payload.data)
        else:
            payload.nbytes = len(ids) * self.modelled_block_bytes
        self.stats.pulled += 1
        return payload

    def release(self, transfer_id: str) -> bool:
        held = self.held.pop(transfer_id, None)
        if held is None:
            return False
        self.kv.pool.free(reversed(held.blocks))
        self.stats.released += 1
        return True

    def expire(self) -> int:
        now = self.clock()
        late = [tid for tid, h in self.held.items() if h.deadline <= now]
        for tid in late:
            self.release(tid)
        if late:
            self.stats.expired += len(late)
            log.info("freed %d held prefills nobody pulled in %.0fs", len(late),
                     self.abort_timeout_s)  # fmt: skip
        return len(late)

    # -- consumer --------------------------------------------------------------------
    def inject(self, request: Request, payload: KVPayload) -> int:
        """Commit a pulled payload into the pool for ``request``; tokens made available.

        ``ValueError`` (nothing changed) when the payload is not of this prompt or does not
        fit; the request is then prefilled locally.
        """
        bs = self.kv.block_size
        pool = self.kv.pool
        request.update_block_hashes(bs)
        n = min(len(payload.block_hashes), (request.num_tokens - 1) // bs)
        if payload.block_hashes[:n] != request.block_hashes[:n]:
            raise ValueError("the pulled KV is not of this prompt (block hashes differ)")
        hashes = request.block_hashes[:n]
        have: list[Block] = []
        for h in hashes:
            block = pool.lookup(h)
            if block is None:
                break
            have.append(block)
        k = len(have)
        pool.touch(have)
        if n - k > pool.num_free_blocks:
            pool.free(reversed(have))
            raise ValueError(f"no room for {n - k} pulled blocks ({pool.num_free_blocks} free)")
        new = pool.take_new(n - k)
        caches = self.kv_caches
        try:
            if caches is not None and new:
                from infergate.engine.kv_transfer.tensors import write_blocks

                write_blocks(caches, [b.block_id for b in new], payload.meta, payload.data, k)
        except Exception:
            pool.free(reversed(have + new))
            raise
        pool.commit(
            new,
            hashes[k:],
            hashes[k - 1] if k else None,
            request.all_token_ids[k * bs : n * bs],
        )
        self.pins[request.request_id] = have + new
        request.num_external_tokens = (n - k) * bs
        self.stats.injected += 1
        self.stats.injected_tokens += (n - k) * bs
        return n * bs

    def after_schedule(self, scheduled: Sequence[Request], scheduler: Scheduler) -> None:
        """Drop pins that are no longer needed, so pinned blocks can never wedge the pool.

        An admitted request holds its own references to the committed blocks (its prefix
        hit), so its pin goes. And when nothing could be scheduled although requests wait
        and none runs, the waiting requests' pins are what block the queue's head: they
        are dropped — the blocks stay in the prefix cache, evictable like any other; a
        request whose blocks get evicted before admission recomputes them.
        """
        for request in scheduled:
            self.unpin(request.request_id)
        if not scheduled and scheduler.waiting and not scheduler.running:
            log.warning("KV cache full of pulled blocks waiting for admission; unpinning %d "
                        "requests' blocks", len(self.pins))  # fmt: skip
            for request_id in list(self.pins):
                self.unpin(request_id)

    def unpin(self, request_id: str) -> None:
        blocks = self.pins.pop(request_id, None)
        if blocks:
            self.kv.pool.free(reversed(blocks))


class EngineHooks:
    """The producer transport's view of the engine: calls posted to the engine thread."""

    def __init__(
        self,
        submit: Callable[[Callable[[EngineCore], Any]], concurrent.futures.Future[Any]],
        transfer: KVTransfer,
        read_timeout_s: float = 30.0,
    ) -> None:
        self.submit = submit
        self.transfer = transfer
        self.read_timeout_s = read_timeout_s

    def read(self, transfer_id: str) -> KVPayload | None:
        future = self.submit(lambda core: self.transfer.read(transfer_id))
        result: KVPayload | None = future.result(timeout=self.read_timeout_s)
        return result

    def release(self, transfer_id: str) -> None:
        self.submit(lambda core: self.transfer.release(transfer_id))

    def expire(self) -> None:
        if self.transfer.held:  # a racy read is fine: the next tick looks again
            self.submit(lambda core: self.transfer.expire())
