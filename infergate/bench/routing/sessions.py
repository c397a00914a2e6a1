"""Closed-loop conversations for the routing lab: each turn is sent once the previous one
has been answered, as an agent or a chat client sends them.

Sessions start at seeded arrival times (``rate ÷ turns`` sessions a second, so the offered
load is ``rate`` turns a second). The same sessions can be sent through two APIs:

* ``chat`` — ``/v1/chat/completions``: every turn re-sends the system prompt, the earlier
  user turns and the answers the engine gave to them.
* ``responses`` — ``/v1/responses``: every turn sends the system prompt as
  ``instructions`` and only its new user input, chained to the conversation with
  ``previous_response_id`` = the id of the last response that succeeded. The engine that
  holds that response has the rest in its store; any other engine answers 404.

The engine builds its response ids with a route tag (:mod:`infergate.wire.responses`):
the one the EPP sends, or the engine's own. A follow-up turn landed on the engine holding
its conversation when its id carries the same tag as the previous turn's; the lab reports
that fraction for the ``responses`` API (a failed follow-up did not land).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from infergate.bench.client import send_request
from infergate.bench.datasets import SampleRequest
from infergate.bench.metrics import RequestResult, arrival_times, compute_metrics
from infergate.bench.runner import first_model
from infergate.wire.responses import route_tag_of

CHAT = "chat"
RESPONSES = "responses"
ENDPOINTS = {CHAT: "/v1/chat/completions", RESPONSES: "/v1/responses"}


@dataclass
class SessionConfig:
    base_url: str
    samples: Sequence[SampleRequest]  # a session's turns share ``group``, in turn order
    api: str  # CHAT or RESPONSES
    request_rate: float
    model: str | None = None
    burstiness: float = 1.0
    seed: int = 0
    request_timeout_s: float = 600.0
    percentiles: Sequence[float] = (50, 90, 99)


@dataclass
class FollowUps:
    """Responses follow-up turns (those naming a previous response) and how many were
    answered by the engine that holds the conversation."""

    sent: int = 0
    on_holder: int = 0
    errors: list[str] = field(default_factory=list)


def sessions_of(samples: Sequence[SampleRequest]) -> list[list[SampleRequest]]:
    """The samples grouped into sessions (by ``group``), each in its given order."""
    sessions: dict[int | None, list[SampleRequest]] = {}
    for sample in samples:
        sessions.setdefault(sample.group, []).append(sample)
    return list(sessions.values())


async def send_response(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any]
) -> tuple[RequestResult, str | None]:
    """Stream one ``/v1/responses`` request; its timing and the response id.

    TTFT is the first ``response.output_text.delta`` event; usage comes from
    ``response.completed`` (or ``response.incomplete``: the output reached
    ``max_output_tokens``); a ``response.failed``/``error`` event fails the request."""
    result = RequestResult(success=False)
    start = time.perf_counter()
    result.start_time = time.time()
    last = start
    text: list[str] = []
    response_id: str | None = None
    usage: dict[str, Any] = {}
    try:
        async with session.post(url, json=payload) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result, None
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[5:])
                kind = event.get("type")
                body = event.get("response") or {}
                if kind == "response.created":
                    response_id = body.get("id")
                elif kind == "response.output_text.delta" and event.get("delta"):
                    if not text:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(event["delta"])
                elif kind in ("response.completed", "response.incomplete"):
                    # incomplete: it stopped at max_output_tokens, as every lab turn does
                    response_id = body.get("id", response_id)
                    usage = body.get("usage") or {}
                elif kind in ("response.failed", "error"):
                    result.error = f"{kind}: {json.dumps(event)[:300]}"
                    return result, None
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result, None
    if not text:
        last = time.perf_counter()
        result.ttft = last - start
    result.latency = last - start
    result.generated_text = "".join(text)
    result.output_tokens = int(usage.get("output_tokens") or len(text))
    result.prompt_len = int(usage.get("input_tokens") or 0)
    result.success = True
    return result, response_id


async def _chat_session(
    http: aiohttp.ClientSession, url: str, model: str, turns: list[SampleRequest]
) -> list[RequestResult]:
    messages: list[dict[str, Any]] = []
    if turns[0].system:
        messages.append({"role": "system", "content": turns[0].system})
    results = []
    for turn in turns:
        messages.append({"role": "user", "content": turn.prompt})
        payload = {
            "model": turn.model or model,
            "messages": list(messages),
            "max_tokens": turn.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = await send_request(http, url, payload)
        results.append(result)
        messages.append({"role": "assistant", "content": result.generated_text})
    return results


async def _responses_session(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    turns: list[SampleRequest],
    follow_ups: FollowUps,
) -> list[RequestResult]:
    previous: str | None = None
    results = []
    for turn in turns:
        payload: dict[str, Any] = {
            "model": turn.model or model,
            "input": turn.prompt,
            "max_output_tokens": turn.output_len,
            "temperature": 0.0,
            "stream": True,
        }
        if turn.system:
            payload["instructions"] = turn.system
        if previous is not None:
            payload["previous_response_id"] = previous
        result, response_id = await send_response(http, url, payload)
        results.append(result)
        if previous is not None:
            follow_ups.sent += 1
            if result.success and route_tag_of(response_id) == route_tag_of(previous):
                follow_ups.on_holder += 1
            elif not result.success and len(follow_ups.errors) < 5:
                follow_ups.errors.append(result.error)
        if result.success and response_id:
            previous = response_id
    return results


async def run_sessions(config: SessionConfig) -> dict[str, Any]:
    """Send every session; metrics with ``vllm bench serve``'s keys, plus for the
    ``responses`` API ``follow_ups`` and ``follow_ups_on_holder``."""
    if config.api not in ENDPOINTS:
        raise ValueError(f"session API must be one of {', '.join(ENDPOINTS)}, not {config.api!r}")
    sessions = sessions_of(config.samples)
    turns = max(1.0, len(config.samples) / max(1, len(sessions)))
    base = config.base_url.rstrip("/")
    url = base + ENDPOINTS[config.api]
    follow_ups = FollowUps()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        model = config.model or await first_model(http, base)
        offsets = arrival_times(
            len(sessions), config.request_rate / turns, config.burstiness, seed=config.seed
        )

        async def one(session_turns: list[SampleRequest]) -> list[RequestResult]:
            if config.api == CHAT:
                return await _chat_session(http, url, model, session_turns)
            return await _responses_session(http, url, model, session_turns, follow_ups)

        started = time.perf_counter()
        tasks = []
        for session_turns, offset in zip(sessions, offsets, strict=True):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session_turns)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - started
    metrics = compute_metrics(results, duration, percentiles=config.percentiles)
    out: dict[str, Any] = {**metrics, "errors": [r.error for r in results if r.error][:5]}
    if config.api == RESPONSES:
        out["follow_ups"] = follow_ups.sent
        out["follow_ups_on_holder"] = follow_ups.on_holder
        out["follow_up_errors"] = follow_ups.errors
    return out
