"""``--kv-transfer-config``: vLLM's ``KVTransferConfig`` JSON, for the connectors we have.

```json
{"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_ip": "0.0.0.0", "kv_port": 14579,
 "kv_connector_extra_config": {"abort_timeout_s": 120, "link_bandwidth_gbps": 0}}
```

``kv_role``: ``kv_producer`` (prefills for others: holds finished prefills' KV for a
decode engine to pull), ``kv_consumer`` (pulls KV from prefill engines) or ``kv_both``.
``kv_ip``/``kv_port`` is where a producer listens for pulls. vLLM's other fields are
accepted when they mean nothing on one device (``kv_rank``, ``kv_parallel_size`` 1…);
unknown fields and connectors we do not have are errors that name them.

Extra config (``kv_connector_extra_config``):

* ``abort_timeout_s`` (default 120, vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` spirit): a
  producer frees a held prefill that nobody pulled after this long.
* ``link_bandwidth_gbps`` (default 0 = not modelled): a pull takes at least
  ``bytes × 8 / (gbps × 10⁹)`` seconds. In simulated mode this is how transfer time is
  modelled (``--kv-transfer-bandwidth-gbps`` sets it too).
* ``advertise_host``: the host decode engines should dial (default: ``kv_ip``, or, when
  that is a wildcard, the host they reached the prefill engine's HTTP server on).
* ``pull_timeout_s`` (default 30): a consumer gives up a pull (and prefills locally).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Our transport, under its own name and the one vLLM examples use for "a TCP/ZMQ connector".
CONNECTORS = ("ZmqConnector", "InfergateConnector")
DEFAULT_KV_PORT = 14579


class ExtraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    abort_timeout_s: float = Field(120.0, gt=0)
    link_bandwidth_gbps: float = Field(0.0, ge=0)
    advertise_host: str | None = None
    pull_timeout_s: float = Field(30.0, gt=0)


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_connector: str
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = Field(DEFAULT_KV_PORT, ge=0, lt=65536)
    kv_rank: int | None = None
    kv_parallel_size: int = Field(1, ge=1, le=1)
    kv_buffer_device: Literal["cpu", "cuda"] | None = None
    kv_buffer_size: float | None = None
    kv_connector_extra_config: ExtraConfig = Field(
        default_factory=lambda: ExtraConfig.model_validate({})
    )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, text: str) -> KVTransferConfig:
        """Parse the flag's JSON; ``ValueError`` names the field that is wrong."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        try:
            config = cls.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"--kv-transfer-config: {where}: {first['msg']}") from None
        if config.kv_connector not in CONNECTORS:
            raise ValueError(
                f"--kv-transfer-config: kv_connector {config.kv_connector!r} is not available "
                f"(available: {', '.join(CONNECTORS)})"
            )
        return config
