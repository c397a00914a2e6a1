"""The connector interface: how a decode engine pulls a prefill engine's KV blocks.

A transport has two halves. The *producer* half runs in the prefill engine and answers
pulls of held prefills by transfer id; the *consumer* half runs in the decode engine and
pulls. What travels is a :class:`KVPayload`: the block hashes (so the decode engine can
check that the blocks are of exactly its prompt), a description of the tensor layout and
the raw bytes. A NIXL/RDMA transport would implement the same two halves, reading the
held blocks in place instead of through :class:`ProducerHooks.read`.

``kv_transfer_params`` — what a prefill engine returns with ``do_remote_decode`` and a
decode engine accepts with ``do_remote_prefill`` — uses vLLM's NIXL connector's keys:
``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port`` and
``remote_request_id`` (our transfer id).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol


class TransferError(Exception):
    """A pull that did not deliver; the decode engine prefills locally instead."""


@dataclass
class KVPayload:
    transfer_id: str
    engine_id: str
    #: Hashes (infergate/wire/block_hash.py) of the transferred blocks, in order.
    block_hashes: list[int]
    #: Tensor layout of ``data`` (``dtype``, ``shape`` = layers × blocks × 2 × block size ×
    #: KV heads × head dim); empty when the runner has no tensors (simulated mode).
    meta: dict[str, Any] = field(default_factory=dict)
    data: bytes = b""
    #: Bytes this payload stands for on the wire (``len(data)`` for real runners; the
    #: modelled KV size in simulated mode).
    nbytes: int = 0

    def header(self) -> dict[str, Any]:
        return {
            "id": self.transfer_id,
            "engine_id": self.engine_id,
            "block_hashes": self.block_hashes,
            "meta": self.meta,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class RemoteParams:
    """Where and what to pull, from a prefill engine's ``kv_transfer_params``."""

    transfer_id: str
    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]

    @classmethod
    def parse(cls, params: dict[str, Any], fallback_host: str | None = None) -> RemoteParams:
        """``ValueError`` naming the key when ``params`` cannot be pulled from."""

        def need(key: str, kind: type) -> Any:
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{key} must be a {kind.__name__}")
            return value

        host = params.get("remote_host")
        if not isinstance(host, str) or not host or host in ("0.0.0.0", "::", "*"):
            if fallback_host is None:
                raise ValueError("kv_transfer_params.remote_host must be a host name or IP")
            host = fallback_host
        port = need("remote_port", int)
        if not 0 < port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be in 1..65535")
        ids = need("remote_block_ids", list)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of integers")
        return cls(
            transfer_id=need("remote_request_id", str),
            engine_id=str(params.get("remote_engine_id") or ""),
            host=host,
            port=port,
            block_ids=tuple(ids),
        )


class ProducerHooks(Protocol):
    """What a producer transport needs from its engine (thread-safe; they may block)."""

    def read(self, transfer_id: str) -> KVPayload | None:
        """The held prefill's payload, None when unknown (expired, released)."""
        ...

    def release(self, transfer_id: str) -> None:
        """Free a held prefill (pulled, or the decode side gave up)."""
        ...

    def expire(self) -> None:
        """Free held prefills older than the abort timeout."""
        ...


class KVConnector(abc.ABC):
    """One engine's transport; ``start_producer`` only on producer engines."""

    @abc.abstractmethod
    def start_producer(self, hooks: ProducerHooks) -> tuple[str, int]:
        """Start answering pulls; returns the (host, port) it listens on."""

    @abc.abstractmethod
    async def pull(self, remote: RemoteParams) -> KVPayload:
        """Fetch a held prefill's payload (the producer frees it once sent)."""

    @abc.abstractmethod
    async def release(self, remote: RemoteParams) -> None:
        """Tell the producer the decode side will not pull (best effort)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the producer thread and close sockets (idempotent)."""
