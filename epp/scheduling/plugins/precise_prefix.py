"""Precise prefix-cache affinity from the engines' own KV-cache events (llm-d's
``precise-prefix-cache-scorer``).

Each engine publishes vLLM-format KV events over ZMQ PUB (``[topic, seq, msgpack
batch]``; events ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). The plugin
subscribes to every endpoint (``tcp://ADDRESS:PORT``, the port from the endpoint label
``infergate.io/kv-events-port`` or the ``kvEventsPort`` parameter) and keeps block hash →
endpoints. To score a request it tokenizes the prompt exactly as the engine would (the
engine's ``POST /tokenize``, which also applies the chat template, or a local
``tokenizer.json`` for plain prompts) and hashes full blocks with the engine's recipe
(:mod:`infergate.engine.block_hash`); the score is the fraction of the prompt's blocks an
endpoint holds as a leading run. Unlike the approximate index, evictions are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from infergate.epp.scheduling.plugins.base import PluginContext, PrepareData, Scorer, register
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("infergate.epp.precise_prefix")

KV_EVENTS_PORT_LABEL = "infergate.io/kv-events-port"
#: ``context.extras`` key: callables(endpoint_key) told when an engine cleared its KV cache.
CACHE_CLEARED_LISTENERS = "kv_cache_cleared_listeners"


class PrecisePrefixParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kvEventsPort: int = Field(5557, gt=0, lt=65536)
    blockSize: int | None = Field(
        None,
        ge=1,
        description="Tokens per KV block (the engines' --block-size); default: what the "
        "engines report in vllm:cache_config_info, else 16.",
    )
    tokenizerPath: str | None = Field(
        None,
        description="Directory or tokenizer.json for plain prompts; else the engine's /tokenize.",
    )
    tokenizeTimeout: float = Field(1.0, gt=0)
    maxPrefixBlocksToMatch: int = Field(1024, ge=1)


class KVBlockIndex:
    """Block hash → endpoints that hold it, fed by KV events."""

    def __init__(self) -> None:
        self.holders: dict[Any, set[str]] = {}
        self.by_endpoint: dict[str, set[Any]] = {}

    def stored(self, endpoint: str, hashes: Sequence[Any]) -> None:
        mine = self.by_endpoint.setdefault(endpoint, set())
        for h in hashes:
            mine.add(h)
            self.holders.setdefault(h, set()).add(endpoint)

    def removed(self, endpoint: str, hashes: Sequence[Any]) -> None:
        mine = self.by_endpoint.get(endpoint)
        if mine is None:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                holders = self.holders.get(h)
                if holders is not None:
                    holders.discard(endpoint)
                    if not holders:
                        del self.holders[h]

    def cleared(self, endpoint: str) -> None:
        self.removed(endpoint, list(self.by_endpoint.get(endpoint, ())))
        self.by_endpoint.pop(endpoint, None)

    def leading_matches(self, hashes: Sequence[Any]) -> dict[str, int]:
        matches: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self.holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for endpoint in alive:
                matches[endpoint] = i + 1
        return matches


def apply_batch(index: KVBlockIndex, endpoint: str, payload: bytes) -> dict[str, int]:
    """Apply one msgpack ``KVEventBatch`` (``[ts, events, dp_rank]``); returns event counts.

    Decoded generically (tagged arrays, tag first) so older and newer vLLM field lists work.
    """
    counts: dict[str, int] = {}
    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    for event in batch[1]:
        if not isinstance(event, list | tuple) or not event:
            continue
        tag = event[0]
        if tag == "BlockStored" and len(event) > 1 and isinstance(event[1], list):
            index.stored(endpoint, event[1])
        elif tag == "BlockRemoved" and len(event) > 1 and isinstance(event[1], list):
            index.removed(endpoint, event[1])
        elif tag == "AllBlocksCleared":
            index.cleared(endpoint)
        else:
            continue
        counts[tag] = counts.get(tag, 0) + 1
    return counts


@register
class PrecisePrefixCacheScorer(PrepareData, Scorer):
    type_name = "precise-prefix-cache-scorer"
    Params = PrecisePrefixParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.p: PrecisePrefixParams = params  # type: ignore[assignment]
        self.index = KVBlockIndex()
        self._subscribers: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._zmq: Any = None
        self._local_tokenizer: Any = None
        if self.p.tokenizerPath:
            from tokenizers import Tokenizer

            path = Path(self.p.tokenizerPath)
            self._local_tokenizer = Tokenizer.from_file(
                str(path / "tokenizer.json" if path.is_dir() else path)
            )
        context.datastore.subscribe(self._on_endpoints)

    async def start(self) -> None:
        import zmq.asyncio

        self._zmq = zmq.asyncio.Context()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.p.tokenizeTimeout)
        )
        self._on_endpoints([s.endpoint for s in self.context.datastore.all()], [])

    async def stop(self) -> None:
        tasks = list(self._subscribers.values())
        self._subscribers.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    def events_address(self, endpoint: Endpoint) -> str:
        port = endpoint.label(KV_EVENTS_PORT_LABEL) or str(self.p.kvEventsPort)
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        return f"tcp://{host}:{port}"

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            task = self._subscribers.pop(endpoint.key, None)
            if task is not None:
                task.cancel()
            self.index.cleared(endpoint.key)
        if self._zmq is None:
            return
        for endpoint in added:
            if endpoint.key not in self._subscribers:
                self._subscribers[endpoint.key] = asyncio.get_running_loop().create_task(
                    self._subscribe(endpoint), name=f"kv-events {endpoint.key}"
                )

    async def _subscribe(self, endpoint: Endpoint) -> None:
        import zmq

        socket = self._zmq.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.events_address(endpoint))
        metrics = self.context.extras.get("metrics")
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    counts = apply_batch(self.index, endpoint.key, frames[-1])
                except Exception as error:
                    log.warning("bad KV event batch from %s: %s", endpoint.key, error)
                    continue
                if counts.get("AllBlocksCleared"):
                    # A real, total eviction: whatever the approximate index believes
                    # about this endpoint is now wrong too.
                    for listener in self.context.extras.get(CACHE_CLEARED_LISTENERS, ()):
                        listener(endpoint.key)
                if metrics is not None:
                    for tag, n in counts.items():
                        metrics.kv_events.labels(tag).inc(n)
        finally:
            socket.close(0)

    async def _tokens(
        self, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[int] | None:
        body = request.body or {}
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self._local_tokenizer is not None and isinstance(prompt, str):
            return list(self._local_tokenizer.encode(prompt).ids)
        if self._session is None or not endpoints:
            return None
        payload: dict[str, Any] = {"model": request.target_model or None}
        if isinstance(body.get("messages"), list):
            payload["messages"] = body["messages"]
        elif isinstance(prompt, str):
            payload["prompt"] = prompt
        else:
            return None
        url = f"http://{endpoints[0].key}/tokenize"
        try:
            async with self._session.post(url, json=payload) as response:
                if response.status != 200:
                    return None
                data = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.debug("tokenize via %s failed: %s", url, error)
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return tokens if isinstance(tokens, list) else None

    async def prepare(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> None:
        from infergate.engine.block_hash import block_hashes

        tokens = await self._tokens(request, endpoints) if request.body else None
        if not tokens:
            cycle["precise.hashes"] = []
            return
        block = self.p.blockSize or next(
            (e.metrics.block_size for e in endpoints if e.metrics.block_size > 0), 16
        )
        tokens = tokens[: block * self.p.maxPrefixBlocksToMatch]
        hashes = block_hashes(tokens, block, cache_salt=request.cache_salt or None)
        cycle["precise.hashes"] = hashes
        cycle["precise.matches"] = self.index.leading_matches(hashes) if hashes else {}

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        hashes = cycle.get("precise.hashes") or []
        if not hashes:
            return [0.0] * len(endpoints)
        matches: dict[str, int] = cycle.get("precise.matches") or {}
        return [matches.get(e.key, 0) / len(hashes) for e in endpoints]
