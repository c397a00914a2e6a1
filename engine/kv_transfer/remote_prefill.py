"""The decode engine's side of P/D: llm-d's routing sidecar, inside the engine's server.

A request reaches the decode engine with the EPP's prefill pick in ``x-prefiller-host-port``.
The decode engine then

1. sends the same request to that engine with ``max_tokens: 1``, ``stream: false`` and
   ``kv_transfer_params: {do_remote_decode: true}`` — the prefill engine computes the
   prompt's KV, holds the blocks and answers with ``kv_transfer_params`` naming them;
2. pulls the blocks over the connector (the prefill engine frees them once sent);
3. hands the payload to the engine core, which commits it into its pool and decodes.

Any failure on the way — the prefill engine down, slow, answering an error, a pull that
breaks — is logged and counted, and the request is prefilled locally: disaggregation is
an optimisation, never a reason to fail a request. A client may also do step 1 itself and
send ``kv_transfer_params`` with ``do_remote_prefill`` (vLLM's proxy flow); then only
step 2 runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import zmq
from infergate.engine.kv_transfer.connector import (
    KVConnector,
    KVPayload,
    RemoteParams,
    TransferError,
)

from infergate.wire.names import PREFILL_HEADER

log = logging.getLogger(__name__)

#: Fields that make no sense for (or would break) a one-token prefill request.
_DROPPED = ("stream_options", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
            "best_of", "min_tokens", "max_completion_tokens")  # fmt: skip


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: the client's request, one token, not streamed, KV held."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out.update(
        max_tokens=1,
        stream=False,
        n=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    return out


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; ``ValueError`` otherwise."""
    value = value.strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{PREFILL_HEADER}: expected host:port, got {value!r}")
    return host, int(port)


@dataclass
class Outcomes:
    pulled: int = 0  # requests decoded from a pulled prefill
    fallback: int = 0  # requests that fell back to a local prefill
    bytes_pulled: int = 0


class RemotePrefiller:
    def __init__(
        self, connector: KVConnector, *, api_key: str | None = None, timeout_s: float = 60.0
    ) -> None:
        self.connector = connector
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.outcomes = Outcomes()
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
        return self._client

    async def prefill_and_pull(
        self, path: str, body: dict[str, Any], prefiller: str, request_id: str = ""
    ) -> KVPayload | None:
        """Steps 1-2 for ``prefiller`` (the header's value); None means prefill locally."""
        try:
            host, port = split_host_port(prefiller)
            url = f"http://{'[' + host + ']' if ':' in host else host}:{port}{path}"
            response = await self._http().post(
                url, json=prefill_body(body), headers={**self.headers, "x-request-id": request_id}
            )
            if response.status_code != 200:
                raise TransferError(f"prefill engine answered {response.status_code}: "
                                    f"{response.text[:200]}")  # fmt: skip
            params = response.json().get("kv_transfer_params")
            if not isinstance(params, dict):
                raise TransferError("the prefill engine returned no kv_transfer_params")
            remote = RemoteParams.parse(params, fallback_host=host)
        except (httpx.HTTPError, ValueError, TransferError) as error:
            self.outcomes.fallback += 1
            log.warning("request %s: remote prefill on %s failed (%s); prefilling locally",
                        request_id, prefiller, error)  # fmt: skip
            return None
        return await self.pull(remote, request_id)

    async def pull(self, remote: RemoteParams, request_id: str = "") -> KVPayload | None:
        """Step 2; None (after telling the producer) when the pull fails."""
        try:
            payload = await self.connector.pull(remote)
        except asyncio.CancelledError:  # the client left: let the producer free now
            task = asyncio.ensure_future(self._release(remote))
            task.add_done_callback(lambda t: t.exception())
            raise
        except (TransferError, zmq.ZMQError, ValueError, KeyError) as error:
            self.outcomes.fallback += 1
            log.warning("request %s: pulling KV from %s:%d failed (%s); prefilling locally",
                        request_id, remote.host, remote.port, error)  # fmt: skip
            await self._release(remote)
            return None
        self.outcomes.pulled += 1
        self.outcomes.bytes_pulled += payload.nbytes
        return payload

    async def _release(self, remote: RemoteParams) -> None:
        with contextlib.suppress(Exception):
            await self.connector.release(remote)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
