"""Send one streaming OpenAI request and time it the way ``vllm bench serve`` does."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from infergate.bench.datasets import SampleRequest
from infergate.bench.metrics import RequestResult

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


def build_payload(
    sample: SampleRequest,
    *,
    endpoint: str,
    model: str,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body: a streaming request that asks for usage in the last chunk."""
    payload: dict[str, Any] = {
        "model": sample.model or model,
        "max_tokens": sample.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT_ENDPOINT:
        if sample.messages is not None:
            payload["messages"] = sample.messages
        else:
            messages = [{"role": "system", "content": sample.system}] if sample.system else []
            payload["messages"] = [*messages, {"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = f"{sample.system}\n{sample.prompt}" if sample.system else sample.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    *,
    prompt_len: int | None = None,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """Stream one request. TTFT is the first chunk carrying generated text (a chat
    role-only preamble is not a token); each later text chunk adds one ITL gap."""
    result = RequestResult(success=False, prompt_len=prompt_len or 0)
    start = time.perf_counter()
    result.start_time = time.time()
    last = start
    text: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                body = await response.text()
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                piece = _chunk_text(chunk)
                if not piece:
                    continue
                if not text:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                text.append(piece)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.generated_text = "".join(text)
    if not text:  # a finished stream with no text (e.g. EOS first): its end is its "token"
        last = time.perf_counter()
        result.ttft = last - start
    result.latency = last - start
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
    if not result.output_tokens:
        # No usage from the server: count streamed chunks (one token each on vLLM-style servers).
        result.output_tokens = len(text)
    result.success = True
    return result
