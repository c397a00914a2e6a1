"""Approximate prefix-cache affinity (GIE's ``prefix-cache-scorer``), calibrated by the engines.

The EPP cannot see the engines' KV caches, so it remembers what it sent where: the prompt
is cut into fixed-size character blocks (``blockSizeTokens`` × 4 characters, GIE's block
size), each block's hash chains over the previous one and starts from a hash of the
target model and ``cache_salt``, so equal hashes mean equal prefixes. Each endpoint keeps
an LRU of the block hashes routed to it, recorded at pre-request, tail first: an engine
frees a request's blocks tail first, so a full cache loses a prefix from its end and
keeps its head, and the index forgets in that order too. The score is the fraction of
the request's blocks that form a cached prefix on that endpoint.
The index and the block hashing, in Python or native where built, are
:mod:`infergate.epp.scheduling.prefix_index`; this plugin decides what goes in and reads it.

Three things keep the index true to the engines rather than to a fixed guess:

* **Capacity** per endpoint is what the engine reports in ``vllm:cache_config_info``:
  ``num_gpu_blocks × block_size`` tokens, converted to index blocks with the learned
  characters-per-token of the model (``capacity_blocks = tokens × cpt / block_chars ×
  scale``). ``scale`` starts at ``capacityFraction`` and is corrected by the ground
  truth below: a *missed hit* (the engine still had blocks the index had already let
  go) raises it by ``capacityStep``, a *false hit* (the engine had evicted what the
  index still held) lowers it, so the index's LRU settles at the size of the engine's
  effective cache (what running requests' own blocks leave for prefixes).
  ``lruCapacityPerServer`` applies only to engines that report nothing.
* **Characters per token** are learned from responses' ``usage.prompt_tokens``
  (:mod:`infergate.epp.datalayer.calibration`).
* **Ground truth**: each response's ``usage.prompt_tokens_details.cached_tokens`` is
  compared with what the index predicted for the endpoint that served it. When the
  engine had less than half of what was predicted, the first block it missed was
  evicted there — and,
  the engine's cache being LRU, so was every block last used before it. Those entries
  are dropped (a per-entry sequence number records when each was last used). Both
  numbers are exported as metrics, with a hit-prediction accuracy.

Several EPP replicas keep one index each. So that a replica also knows the prefixes the
others routed, the routing replica sends the request's block hashes to the engine in
:data:`~infergate.wire.names.PREFIX_HEADER`; the engine publishes them in an admission
record (:mod:`infergate.wire.completions`) and every other replica adds them for that
engine (:meth:`PrefixCacheScorer.learn`), as if it had routed the request itself. The
replicas must share the scorer's block size (one config), or the hashes do not match.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infergate.epp.compact_json import compact_json
from infergate.epp.framework.requestcontrol import (
    PrepareData,
    PreRequest,
    RequestAdmitted,
    ResponseComplete,
    ResponseInfo,
)
from infergate.epp.scheduling.plugins.base import PluginContext, SchedulingResult, Scorer, register
from infergate.epp.scheduling.prefix_index import PrefixIndex, packed_block_hashes, tail_first
from infergate.epp.types import (
    RENDERED_APIS,
    CycleState,
    Endpoint,
    EndpointState,
    InferenceRequest,
)
from pydantic import BaseModel, ConfigDict, Field

from infergate.wire.completions import encode_prefix, is_packed_prefix
from infergate.wire.names import PREFIX_HEADER

log = logging.getLogger("infergate.epp.prefix")

#: GIE's characters per token, used only to size hash blocks (never for capacity).
CHARS_PER_TOKEN = 4
NOTE = "prefix"
#: Index blocks of disagreement that are rounding, not eviction (see response_complete).
SLACK_BLOCKS = 2


class PrefixParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    blockSizeTokens: int = Field(16, ge=1)
    blockSize: int = Field(0, ge=0, description="Legacy: block size in characters (wins if > 0).")
    maxPrefixBlocksToMatch: int = Field(256, ge=1)
    lruCapacityPerServer: int = Field(
        31250, ge=1, description="Index blocks per endpoint when the engine reports no capacity."
    )
    capacityFraction: float = Field(
        1.0,
        gt=0,
        le=2,
        description="Starting share of the engine's KV cache assumed to hold prefixes "
        "(corrected per endpoint by the engines' cached_tokens).",
    )
    capacityStep: float = Field(
        0.02, ge=0, lt=1, description="Correction of that share per wrong hit prediction."
    )
    shareWithReplicas: bool = Field(
        True,
        description="Send the prompt's block hashes to the engine, which echoes them to "
        "every EPP replica (off: a single replica saves the header and the record).",
    )
    autoTune: bool = True  # accepted for GIE compatibility; the block size stays fixed here


def _prompt_source(request: InferenceRequest) -> str | bytes:
    """The prefix key's text: chat messages as compact JSON (already UTF-8 bytes, from
    :func:`~infergate.epp.compact_json.compact_json`), else the prompt or rendered conversation."""
    body = request.body or {}
    messages = body.get("messages")
    if isinstance(messages, list) and request.api not in RENDERED_APIS:
        return compact_json(messages)
    return request.prompt_text


def prompt_bytes(request: InferenceRequest) -> bytes:
    """The text whose prefix decides cache reuse: chat messages (as JSON), the rendered
    conversation of a Responses or Anthropic Messages body, or the prompt, in UTF-8.

    Lone surrogates (valid JSON escapes, not valid UTF-8) are replaced, never raised on.
    """
    source = _prompt_source(request)
    return source if isinstance(source, bytes) else source.encode("utf-8", "replace")


def prompt_head(request: InferenceRequest, limit: int) -> tuple[bytes, int]:
    """The first ``limit`` bytes of :func:`prompt_bytes` and its whole length.

    An ASCII prompt is not encoded past ``limit`` (its length in bytes is its length in
    characters, and ``str.isascii`` reads a flag CPython keeps): a 220 KB prompt is
    hashed over 16 KB, and encoding the rest was 6 % of the EPP's CPU per request.
    """
    source = _prompt_source(request)
    if isinstance(source, bytes):
        return source[: max(0, limit)], len(source)
    if source.isascii():
        return source[: max(0, limit)].encode("ascii"), len(source)
    data = source.encode("utf-8", "replace")
    return data[: max(0, limit)], len(data)


@dataclass(slots=True)
class Prediction:
    """What the index said about the endpoint a request went to (kept until its response)."""

    server: str
    model: str
    chars: int
    hashes: bytes  # packed (:func:`packed_block_hashes`)
    matched: int  # leading blocks predicted cached there
    #: Last-use sequence number of the first block predicted cached beyond each position
    #: (``seqs[i]``: block i's entry before this request refreshed it).
    seqs: list[int]
    #: The calibration has this request's sample already (from its admission record).
    calibrated: bool = False


@register
class PrefixCacheScorer(PrepareData, Scorer, PreRequest, RequestAdmitted, ResponseComplete):
    type_name = "prefix-cache-scorer"
    Params = PrefixParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p: PrefixParams = params  # type: ignore[assignment]
        self.p = p
        self.block_chars = p.blockSize or p.blockSizeTokens * CHARS_PER_TOKEN
        self.max_blocks = p.maxPrefixBlocksToMatch
        self.index = PrefixIndex(p.lruCapacityPerServer)
        self.calibration = context.calibration
        context.datastore.subscribe(self._on_endpoints)
        # Real evictions reported by engines (precise-prefix-cache-scorer) correct this index.
        context.extras.setdefault("kv_cache_cleared_listeners", []).append(self.index.clear_server)
        context.extras["prefix_index"] = self
        self.metrics: Any = context.extras.get("metrics")
        self.lookups = 0
        self.hit_blocks = 0
        self.total_blocks = 0
        self.dropped_stale = 0
        #: Hashes learned from other replicas' routing (admission records).
        self.learned_blocks = 0
        self._datastore = context.datastore
        #: Per endpoint: the share of its reported KV cache the index models.
        self.capacity_scale: dict[str, float] = {}

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            self.index.clear_server(endpoint.key)
            self.capacity_scale.pop(endpoint.key, None)

    def capacity_blocks(self, state: EndpointState, model: str) -> int | None:
        """Index blocks the engine can hold: reported KV tokens × chars/token ÷ block chars."""
        tokens = state.metrics.capacity_tokens
        if tokens <= 0:
            return None
        scale = self.capacity_scale.get(state.key, self.p.capacityFraction)
        chars = tokens * self.calibration.chars_per_token(model) * scale
        return max(1, int(chars // self.block_chars))

    def refresh_capacity(self, state: EndpointState, model: str) -> None:
        """Bound ``state``'s index LRU by what its engine reports now. Done where an
        endpoint's capacity is read (its free room is scored, or a prefix is added to it),
        not for the whole pool on every request: that pass would cost O(pool) per
        decision."""
        capacity = self.capacity_blocks(state, model)
        if capacity is not None:
            self.index.set_capacity(state.key, capacity)

    def free_tokens(self, state: EndpointState, model: str) -> float | None:
        """Tokens of ``state``'s cache the index believes hold no routed prefix (None:
        the engine reports no capacity)."""
        if state.metrics.capacity_tokens <= 0:
            return None
        self.refresh_capacity(state, model)
        free_blocks = self.index.capacity_of(state.key) - self.index.size(state.key)
        return self.tokens_for_blocks(model, max(0, free_blocks))

    def occupancy(self, states: Sequence[EndpointState]) -> float:
        """The share of these endpoints' index capacity in use, Σ held ÷ Σ capacity (in
        index blocks; capacities as last refreshed, e.g. by :meth:`free_tokens`)."""
        held = capacity = 0
        for state in states:
            held += self.index.size(state.key)
            capacity += self.index.capacity_of(state.key)
        return min(1.0, held / capacity) if capacity > 0 else 0.0

    def tokens_for_blocks(self, model: str, blocks: int) -> float:
        """Predicted cached tokens for ``blocks`` matched index blocks."""
        return self.calibration.tokens(model, blocks * self.block_chars)

    async def prepare(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> None:
        data, length = prompt_head(request, self.block_chars * self.max_blocks)
        model = request.target_model or request.model
        hashes = packed_block_hashes(
            model, request.cache_salt, data, self.block_chars, self.max_blocks
        )
        matches = self.index.match(hashes) if hashes else {}
        cycle["prefix.chars"] = length
        cycle["prefix.tokens"] = self.calibration.tokens(model, length)
        cycle["prefix.hashes"] = hashes  # packed: 8 bytes a block
        cycle["prefix.blocks"] = len(hashes) // 8
        cycle["prefix.matches"] = matches
        cycle["prefix.max_match"] = max(matches.values(), default=0)
        cycle["prefix.cached_tokens"] = {
            server: self.tokens_for_blocks(model, n) for server, n in matches.items()
        }
        if hashes:
            self.lookups += 1
            self.total_blocks += len(hashes) // 8

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        total: int = cycle.get("prefix.blocks") or 0
        if not total:
            return [0.0] * len(endpoints)
        matches: dict[str, int] = cycle.get("prefix.matches") or {}
        return [matches.get(e.key, 0) / total for e in endpoints]

    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        hashes: bytes = cycle.get("prefix.hashes") or b""
        primary = result.primary
        if primary is None:
            return
        matches: dict[str, int] = cycle.get("prefix.matches") or {}
        matched = matches.get(primary.key, 0)
        seqs = self.index.last_uses(primary.key, hashes[: matched * 8])
        prediction_chars = int(cycle.get("prefix.chars", 0))
        request.notes[NOTE] = Prediction(
            primary.key,
            request.target_model or request.model,
            prediction_chars,
            hashes,
            matched,
            seqs,
        )
        if not hashes:
            return
        self.hit_blocks += matched
        cycle["prefix.hit_ratio"] = matched / (len(hashes) // 8)
        cycle["prefix.hit_bytes"] = min(matched * self.block_chars, prediction_chars)
        self.refresh_capacity(primary, request.target_model or request.model)
        self.index.add(primary.key, tail_first(hashes))
        if self.p.shareWithReplicas:
            result.request_headers[PREFIX_HEADER] = encode_prefix(hashes)

    def learn(self, endpoint_key: str, packed: bytes) -> int:
        """Add the hashes another replica routed to ``endpoint_key`` (an admission record's
        ``prefix``); returns how many. Unknown endpoints and malformed input add nothing."""
        if self._datastore.get(endpoint_key) is None:
            return 0
        if not is_packed_prefix(packed):
            return 0
        hashes = packed[: self.max_blocks * 8]
        if hashes:
            self.index.add(endpoint_key, tail_first(hashes))
            self.learned_blocks += len(hashes) // 8
        return len(hashes) // 8

    def request_admitted(
        self, request: InferenceRequest, result: SchedulingResult, prompt_tokens: int
    ) -> None:
        """Calibrate characters per token from the engine's count as it takes the prompt:
        a response comes a whole generation later, and until the first one the index and
        the latency model would size every prompt with the 4-characters default (in the
        routing lab, with the tiny model, a 2,549-token prompt looked like 993 tokens, so a
        cold engine looked 2.5x cheaper than it was and the first requests of a group were
        copied to other engines instead of waiting a few ms for their holder)."""
        prediction: Prediction | None = request.notes.get(NOTE)
        if prediction is None or prediction.calibrated or not self._calibrates(request):
            return
        prediction.calibrated = True
        self.calibration.observe(prediction.model, prediction.chars, prompt_tokens)

    @staticmethod
    def _calibrates(request: InferenceRequest) -> bool:
        """Whether the engine's prompt tokens describe the text this EPP hashed: not when
        the engine prepended a stored conversation (``previous_response_id``: text this
        EPP never saw), nor for a list of prompts (the admission record counts the first)."""
        if request.previous_response_id:
            return False
        return not isinstance((request.body or {}).get("prompt"), list)

    def response_complete(
        self, request: InferenceRequest, result: SchedulingResult, response: ResponseInfo
    ) -> None:
        prediction: Prediction | None = request.notes.pop(NOTE, None)
        if prediction is None or not response.complete or not response.prompt_tokens:
            return
        if request.previous_response_id:
            # The engine prepended the stored conversation: its prompt and cached tokens
            # describe text this EPP never saw, so they calibrate nothing here.
            return
        if not prediction.calibrated:
            self.calibration.observe(prediction.model, prediction.chars, response.prompt_tokens)
        if response.cached_tokens is None or not prediction.hashes:
            return
        server = response.served_endpoint or prediction.server
        if server != prediction.server:
            return  # served by a fallback: the prediction was for another endpoint
        predicted = self.tokens_for_blocks(prediction.model, prediction.matched)
        actual = response.cached_tokens
        if self.metrics is not None:
            self.metrics.observe_prefix_prediction(predicted, actual)
        # Blocks the engine really had: whole index blocks inside its cached tokens.
        held = int(actual * self.calibration.chars_per_token(prediction.model) // self.block_chars)
        matched = prediction.matched
        # Small differences are rounding (index blocks against the engine's 16-token blocks;
        # the engine never counts a prompt's last token) or a prefix still being prefilled
        # by an earlier request (the engine has its first chunks only). Only a miss of at
        # least half of what was predicted is evidence of eviction, and only the mirror
        # case is evidence that the index forgot blocks the engine kept.
        evicted = matched - held > SLACK_BLOCKS and held < matched // 2
        forgotten = held - matched > SLACK_BLOCKS and matched < held // 2
        if log.isEnabledFor(logging.DEBUG) and (evicted or forgotten):
            log.debug(
                "prefix prediction off on %s: predicted %d blocks (%.0f tokens), the engine "
                "had %d tokens cached (%d blocks); index holds %d of %d blocks",
                server, matched, predicted, actual, held,
                self.index.size(server), self.index.capacity_of(server),
            )  # fmt: skip
        if evicted:
            self.dropped_stale += self.index.drop_older_than(server, prediction.seqs[held])
            self._correct_capacity(server, -self.p.capacityStep)
        elif forgotten:
            self._correct_capacity(server, self.p.capacityStep)

    def _correct_capacity(self, server: str, step: float) -> None:
        scale = self.capacity_scale.get(server, self.p.capacityFraction)
        self.capacity_scale[server] = min(2.0, max(0.25, scale * (1.0 + step)))
