"""An OpenAI request's sampling fields → validated :class:`SamplingParams`.

Every refusal is a 400 naming the field; omitted fields take the model's
``generation_config.json`` defaults (``--generation-config``) as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from infergate.engine.entrypoints.protocol import _Sampling, unsupported
from infergate.engine.interfaces import SamplingParams

from .config import ServerConfig
from .errors import APIError


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"Token id {bad} is out of vocabulary (size {vocab_size}).", param)


def _check_ranges(req: _Sampling, max_tokens: int | None) -> None:
    """The per-field checks that need nothing but the request."""
    problem = unsupported(req)
    if problem is not None:
        raise APIError(400, problem[1], problem[0])
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true.", "stream_options")
    for name in ("temperature", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):  # fmt: skip
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise APIError(400, f"{name} must be a finite number.", name)
    if req.temperature is not None and req.temperature < 0:
        raise APIError(400, "temperature must be non-negative.", "temperature")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise APIError(400, f"{name} must be in [-2, 2].", name)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise APIError(400, "repetition_penalty must be positive.", "repetition_penalty")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise APIError(400, "min_p must be in [0, 1].", "min_p")
    if req.min_tokens is not None and req.min_tokens < 0:
        raise APIError(400, "min_tokens must be non-negative.", "min_tokens")
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(400, "min_tokens must not exceed max_tokens.", "min_tokens")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise APIError(400, "top_p must be in (0, 1].", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise APIError(400, "top_k must be -1 (disabled) or a positive integer.", "top_k")
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError(400, "cache_salt must be a non-empty string.", "cache_salt")


def _check_length(config: ServerConfig, prompt_len: int, max_tokens: int | None) -> int:
    """Room left for output after the prompt; 400 when the prompt or max_tokens overflow."""
    if prompt_len == 0:
        raise APIError(400, "The prompt is empty.", "prompt")
    room = config.max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. "
            f"However, your prompt has {prompt_len} tokens.",
            "prompt",
        )
    if max_tokens is not None:
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        if max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. "
                f"However, you requested {prompt_len + max_tokens} tokens "
                f"({prompt_len} in the prompt, {max_tokens} in the completion).",
                "max_tokens",
            )
    return room


def parse_logit_bias(
    raw: dict[str, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} as (id, bias) pairs."""
    out = []
    for key, value in (raw or {}).items():
        if not key.lstrip("-").isdigit():
            raise APIError(400, f"logit_bias key {key!r} is not a token id.", "logit_bias")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias token {token} is out of vocabulary.", "logit_bias")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise APIError(400, "logit_bias values must be in [-100, 100].", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def default_max_tokens(config: ServerConfig, default: int | None, room: int) -> int:
    value = min(default or room, room)
    if config.default_max_tokens_cap is not None:
        value = min(value, config.default_max_tokens_cap)
    return value


def to_sampling_params(
    req: _Sampling,
    config: ServerConfig,
    prompt_len: int,
    max_tokens: int | None,
    default_max: int | None,
) -> SamplingParams:
    """Validate `req`'s sampling fields against the model and build the engine's params."""
    _check_ranges(req, max_tokens)
    bias = parse_logit_bias(req.logit_bias, config.vocab_size)
    room = _check_length(config, prompt_len, max_tokens)
    stop_ids = tuple(req.stop_token_ids or ())
    check_token_ids(stop_ids, config.vocab_size, "stop_token_ids")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    gen = config.generation_defaults
    return SamplingParams(
        temperature=gen.get("temperature", 1.0) if req.temperature is None else req.temperature,
        top_p=gen.get("top_p", 1.0) if req.top_p is None else req.top_p,
        top_k=int(gen.get("top_k", -1)) if req.top_k is None else req.top_k,
        seed=req.seed,
        max_tokens=max_tokens
        if max_tokens is not None
        else default_max_tokens(config, default_max, room),
        stop=tuple(s for s in stop if s),
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=gen.get("repetition_penalty", 1.0)
        if req.repetition_penalty is None
        else req.repetition_penalty,
        min_p=gen.get("min_p", 0.0) if req.min_p is None else req.min_p,
        logit_bias=bias,
        min_tokens=req.min_tokens or 0,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
