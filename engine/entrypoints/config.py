"""What the HTTP layer knows about the engine behind it (built by ``engine.serve``)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

MAX_BODY_BYTES = 16 * 2**20
DEFAULT_COMPLETION_MAX_TOKENS = 16
LONG_TEXT_CHARS = 16_384  # tokenize longer texts off the event loop


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_dir: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    # Cap on the default max_tokens (simulated engines never emit EOS on their own).
    default_max_tokens_cap: int | None = None
    supports_logprobs: bool = True  # False for the simulator, which has no logits
    structured_output: bool = True  # grammars need logits too (False for the simulator)
    # Defaults for omitted sampling fields (--generation-config), as vLLM applies them.
    generation_defaults: dict[str, float] = field(default_factory=dict)
    # Tool calling: --enable-auto-tool-choice and --tool-call-parser (vLLM's flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    dev_mode: bool = False  # development routes (/reset_prefix_cache)
    # The Responses API's store (--enable-responses-api-store and its bounds).
    responses_store: bool = True
    responses_store_max_entries: int = 1024
    responses_store_ttl_s: float = 3600.0
    # The tag in this engine's response ids when no EPP sent one (infergate.wire.responses).
    route_tag: str = field(default_factory=lambda: secrets.token_hex(8))
    # --scheduling-policy: with fcfs a request's non-zero priority is a 400 (as vLLM).
    scheduling_policy: str = "fcfs"
    warned_fields: set[str] = field(default_factory=set)
