"""OpenAI request bodies, as pydantic models validated strictly from the raw JSON.

Strict mode makes ``"max_tokens": "5"`` a 400 like OpenAI, not a silent coercion. Every
model allows extra fields: routers add their own (``no_stop_trim``,
``return_hidden_states`` …) and the server ignores them with a warning, as vLLM does.
Fields we know but cannot honour are rejected in :func:`unsupported`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Open):
    model: str | None = None
    stream: bool | None = False  # null is false, as in vLLM
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int | None = 1
    best_of: int | None = None
    cache_salt: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    user: str | None = None
    return_token_ids: bool | None = None  # vLLM extension: token ids in the response
    # Structured output (engine/structured_output/spec.py reads and checks them).
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's scheduling priority (--scheduling-policy priority): lower runs first.
    priority: int = 0
    # vLLM's P/D field (engine/kv_transfer): do_remote_decode / do_remote_prefill + handles.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM extension


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 16


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    prompt_logprobs: int | None = None  # vLLM extension


class TokenizeRequest(_Open):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]


def unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first known field whose value we cannot honour."""
    n = 1 if req.n is None else req.n
    checks: list[tuple[bool, str, str]] = [
        (not 1 <= n <= MAX_N, "n", f"n must be between 1 and {MAX_N}"),
        (
            req.best_of is not None and not n <= req.best_of <= MAX_N,
            "best_of",
            f"best_of must be between n and {MAX_N}",
        ),
        (
            (req.best_of or n) > n and not isinstance(req, CompletionRequest),
            "best_of",
            "best_of > n is only supported on /v1/completions",
        ),
        (
            (req.best_of or n) > n and bool(req.stream),
            "best_of",
            "best_of > n cannot be streamed (the best are known only at the end)",
        ),
        (
            not req.spaces_between_special_tokens,
            "spaces_between_special_tokens",
            "spaces_between_special_tokens=false is not supported",
        ),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            (
                req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (req.suffix is not None, "suffix", "suffix is not supported"),
        ]
    if isinstance(req, (CompletionRequest, ChatCompletionRequest)):
        checks.append((
            req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
        ))  # fmt: skip
    if isinstance(req, ChatCompletionRequest):
        checks += [
            (
                req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS,
                "top_logprobs",
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                bool(req.top_logprobs) and not req.logprobs,
                "top_logprobs",
                "top_logprobs requires logprobs=true",
            ),
        ]
    for bad, param, message in checks:
        if bad:
            return param, message
    return None
