"""Precise prefix-cache affinity from the engines' own KV-cache events (llm-d's
``precise-prefix-cache-scorer``).

The data layer (:mod:`infergate.epp.datalayer.kv_events`) subscribes to every
endpoint's vLLM-format KV events and keeps block hash → endpoints; this plugin reads that
index, and at pre-request adds the request's blocks to the chosen endpoint as
*speculative* entries (llm-d's speculative indexing) that count until the engine's own
``BlockStored`` event confirms them or ``speculativeTTL`` passes. To score a request it tokenizes the prompt exactly as the engine would (the
engine's ``POST /tokenize``, which also applies the chat template, or a local
``tokenizer.json`` for plain prompts) and hashes full blocks with the engine's recipe
(:mod:`infergate.wire.block_hash`); the score is the fraction of the prompt's blocks an
endpoint holds as a leading run. Unlike the approximate index, evictions are real.

Engines started with ``--api-key`` refuse ``/tokenize`` without it, which would make every
score 0.0: the key comes from ``INFERGATE_ENGINE_API_KEY`` (``up`` and the operator set
it), and a failing ``/tokenize`` is logged (once per endpoint every
:data:`TOKENIZE_LOG_EVERY_S`) and counted in ``infergate_epp_tokenize_errors_total``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from infergate.epp.datalayer.kv_events import (
    KV_EVENTS_PORT_LABEL,
    KV_EVENTS_REPLAY_PORT_LABEL,
    KVBlockIndex,
    KVEventSubscriptions,
)
from infergate.epp.framework.requestcontrol import PrepareData, PreRequest
from infergate.epp.options import ENGINE_API_KEY_ENV
from infergate.epp.scheduling.plugins.base import PluginContext, SchedulingResult, Scorer, register
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

from infergate.wire.block_hash import block_hashes

log = logging.getLogger("infergate.epp.precise_prefix")

__all__ = ["KV_EVENTS_PORT_LABEL", "KV_EVENTS_REPLAY_PORT_LABEL", "PrecisePrefixCacheScorer"]
#: ``context.extras`` key: callables(endpoint_key) told when an engine cleared its KV cache.
CACHE_CLEARED_LISTENERS = "kv_cache_cleared_listeners"
#: A failing ``/tokenize`` is logged at most this often per endpoint (every failure counts
#: in the metric): a fleet-wide 401 must be visible without flooding the log.
TOKENIZE_LOG_EVERY_S = 30.0


class PrecisePrefixParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kvEventsPort: int = Field(5557, gt=0, lt=65536)
    kvEventsReplayPort: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="The engines' KV events replay port (vLLM's replay_endpoint) where an "
        "endpoint has no infergate.io/kv-events-replay-port label; none: no replay there.",
    )
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
    apiKeyEnv: str | None = Field(
        None,
        description="Environment variable holding the engines' --api-key; sent as a bearer "
        f"token to their /tokenize (which needs it when the engines have a key). Default: "
        f"{ENGINE_API_KEY_ENV}, when set.",
    )
    maxPrefixBlocksToMatch: int = Field(1024, ge=1)
    speculativeTTL: float = Field(
        2.0,
        ge=0,
        description="Seconds a block the EPP routed counts as held before the engine's "
        "BlockStored event confirms it (0: events only).",
    )


@register
class PrecisePrefixCacheScorer(PrepareData, Scorer, PreRequest):
    type_name = "precise-prefix-cache-scorer"
    Params = PrecisePrefixParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.p: PrecisePrefixParams = params  # type: ignore[assignment]
        self.index = KVBlockIndex(ttl=self.p.speculativeTTL)
        self.events = KVEventSubscriptions(
            context.datastore, self.index, self.p.kvEventsPort, context.extras.get("metrics"),
            default_replay_port=self.p.kvEventsReplayPort,
        )  # fmt: skip
        # A real, total eviction: whatever the approximate index believes about this
        # endpoint is now wrong too.
        self.events.cleared_listeners.extend(context.extras.get(CACHE_CLEARED_LISTENERS, ()))
        self._session: aiohttp.ClientSession | None = None
        self._metrics: Any = context.extras.get("metrics")
        #: endpoint key → (when its last failure was logged, failures not logged since).
        self._failures: dict[str, tuple[float, int]] = {}
        self._local_tokenizer: Any = None
        if self.p.tokenizerPath:
            from tokenizers import Tokenizer

            path = Path(self.p.tokenizerPath)
            self._local_tokenizer = Tokenizer.from_file(
                str(path / "tokenizer.json" if path.is_dir() else path)
            )

    async def start(self) -> None:
        headers = {}
        key = os.environ.get(self.p.apiKeyEnv or ENGINE_API_KEY_ENV, "")
        if self.p.apiKeyEnv and not key:
            log.warning("apiKeyEnv %s is empty: /tokenize will be refused", self.p.apiKeyEnv)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=self.p.tokenizeTimeout)
        )
        # Listeners registered after construction (plugin order) are picked up here.
        for listener in self.context.extras.get(CACHE_CLEARED_LISTENERS, ()):
            if listener not in self.events.cleared_listeners:
                self.events.cleared_listeners.append(listener)
        self.events.start()

    async def stop(self) -> None:
        await self.events.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        endpoint = endpoints[0].key
        try:
            async with self._session.post(f"http://{endpoint}/tokenize", json=payload) as response:
                if response.status != 200:
                    reason = "unauthorized" if response.status in (401, 403) else "http_error"
                    self._tokenize_failed(endpoint, reason, f"HTTP {response.status}")
                    return None
                data = await response.json()
        except TimeoutError:
            self._tokenize_failed(endpoint, "timeout", f"no answer in {self.p.tokenizeTimeout}s")
            return None
        except (aiohttp.ClientError, ValueError) as error:
            self._tokenize_failed(endpoint, "error", f"{type(error).__name__}: {error}")
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            self._tokenize_failed(endpoint, "bad_response", "no 'tokens' list in the answer")
            return None
        return tokens

    def _tokenize_failed(self, endpoint: str, reason: str, detail: str) -> None:
        """Count every failure; log one line per endpoint per :data:`TOKENIZE_LOG_EVERY_S`
        (the request still routes, its precise-prefix score is 0.0 on every endpoint)."""
        if self._metrics is not None:
            self._metrics.tokenize_errors.labels(reason).inc()
        now = time.monotonic()
        last, quiet = self._failures.get(endpoint, (float("-inf"), 0))
        if now - last < TOKENIZE_LOG_EVERY_S:
            self._failures[endpoint] = (last, quiet + 1)
            return
        if len(self._failures) > 4096:  # endpoints come and go; the map must not grow
            self._failures.clear()
        self._failures[endpoint] = (now, 0)
        hint = (
            f": the engines need their --api-key in {self.p.apiKeyEnv or ENGINE_API_KEY_ENV}"
            if reason == "unauthorized"
            else ""
        )
        log.warning(
            "POST http://%s/tokenize failed (%s)%s; precise prefix scores 0 for such requests "
            "(%d more failures on this endpoint since the last line)",
            endpoint, detail, hint, quiet,
        )  # fmt: skip

    async def prepare(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> None:
        tokens = await self._tokens(request, endpoints) if request.body else None
        if not tokens:
            cycle["precise.hashes"] = []
            return
        block = self.p.blockSize or next(
            (e.metrics.block_size for e in endpoints if e.metrics.block_size > 0), 16
        )
        tokens = tokens[: block * self.p.maxPrefixBlocksToMatch]
        hashes = block_hashes(tokens, block, cache_salt=request.cache_salt or None,
                              lora_name=self._adapter(request, endpoints))  # fmt: skip
        matches = self.index.leading_matches(hashes) if hashes else {}
        cycle["precise.hashes"] = hashes
        cycle["precise.matches"] = matches
        # Exact token counts for the predicted-latency scorer (it prefers these to the
        # approximate index's estimates).
        cycle["precise.tokens"] = len(tokens)
        cycle["precise.cached_tokens"] = {e: n * block for e, n in matches.items()}

    def _adapter(self, request: InferenceRequest, endpoints: Sequence[EndpointState]) -> str | None:
        """The request's model when it is a LoRA adapter (engines key adapter KV by it):
        one seen in an engine's KV events or in its ``vllm:lora_requests_info``."""
        model = request.target_model
        if not model:
            return None
        if model in self.index.adapters or any(
            model in e.metrics.active_models or model in e.metrics.waiting_models for e in endpoints
        ):
            return model
        return None

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        hashes = cycle.get("precise.hashes") or []
        if not hashes:
            return [0.0] * len(endpoints)
        matches: dict[str, int] = cycle.get("precise.matches") or {}
        return [matches.get(e.key, 0) / len(hashes) for e in endpoints]

    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        hashes = cycle.get("precise.hashes") or []
        if hashes and result.primary is not None and self.p.speculativeTTL > 0:
            self.index.speculate(result.primary.key, hashes)
