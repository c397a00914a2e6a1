"""What the OpenAI server needs for P/D, in one object built from ``--kv-transfer-config``.

:meth:`KVTransferService.prepare` reads a request's ``kv_transfer_params`` and the EPP's
``x-prefiller-host-port`` header and returns what the engine request carries: the
``kv_transfer_params`` to act on (``do_remote_decode``: hold the KV) and, on a decode
engine, a pulled payload (or None: prefill locally). A request field this engine cannot
honour is a :class:`BadKVParams` (the server answers 400 naming it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infergate.engine.kv_transfer.blocks import EngineHooks, KVTransfer
from infergate.engine.kv_transfer.config import KVTransferConfig
from infergate.engine.kv_transfer.connector import KVConnector, KVPayload, RemoteParams
from infergate.engine.kv_transfer.remote_prefill import RemotePrefiller
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from infergate.wire.names import PREFILL_HEADER

if TYPE_CHECKING:
    from infergate.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


class BadKVParams(ValueError):
    """An OpenAI-shaped 400: ``param`` names the request field."""

    def __init__(self, message: str, param: str = "kv_transfer_params") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Prepared:
    params: dict[str, Any] | None = None  # for the engine request (do_remote_decode)
    payload: KVPayload | None = None  # pulled KV for the engine core to commit


def check_without_transfer(body: dict[str, Any]) -> None:
    """An engine without ``--kv-transfer-config`` refuses to act on kv_transfer_params."""
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and (
        params.get("do_remote_decode") or params.get("do_remote_prefill")
    ):
        raise BadKVParams(
            "kv_transfer_params: this engine has no KV connector (start it with "
            "--kv-transfer-config to take part in prefill/decode disaggregation)"
        )


class KVTransferService:
    def __init__(
        self,
        config: KVTransferConfig,
        transfer: KVTransfer,
        connector: KVConnector,
        *,
        api_key: str | None = None,
    ) -> None:
        self.config = config
        self.transfer = transfer
        self.connector = connector
        self.prefiller = RemotePrefiller(connector, api_key=api_key) if config.is_consumer else None

    def start(self, engine: AsyncEngine) -> None:
        if self.config.is_producer:
            host, port = self.connector.start_producer(EngineHooks(engine.submit, self.transfer))
            advertise = self.config.kv_connector_extra_config.advertise_host or host
            self.transfer.advertise = (advertise, port)
            log.info("KV transfer producer listening on %s:%d (%s)", host, port,
                     self.config.kv_connector)  # fmt: skip

    async def stop(self) -> None:
        if self.prefiller is not None:
            await self.prefiller.close()
        self.connector.close()

    async def prepare(
        self, path: str, body: dict[str, Any], headers: Any, request_id: str
    ) -> Prepared:
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise BadKVParams("kv_transfer_params must be an object")
        params = params or {}
        out = Prepared()
        if params.get("do_remote_decode"):
            if not self.config.is_producer:
                raise BadKVParams(
                    "kv_transfer_params.do_remote_decode: this engine's kv_role is "
                    f"{self.config.kv_role}; it does not hold KV for other engines"
                )
            if body.get("stream"):
                raise BadKVParams(
                    "kv_transfer_params.do_remote_decode needs stream: false", "stream"
                )
            out.params = {"do_remote_decode": True}
            return out
        if params.get("do_remote_prefill"):
            if self.prefiller is None:
                raise BadKVParams(
                    "kv_transfer_params.do_remote_prefill: this engine's kv_role is "
                    f"{self.config.kv_role}; it does not pull KV"
                )
            try:
                remote = RemoteParams.parse(params)
            except ValueError as error:
                raise BadKVParams(str(error)) from None
            out.payload = await self.prefiller.pull(remote, request_id)
            return out
        prefiller = headers.get(PREFILL_HEADER) if headers is not None else None
        if prefiller and self.prefiller is not None:
            out.payload = await self.prefiller.prefill_and_pull(path, body, prefiller, request_id)
        return out


async def apply_kv_transfer(
    service: KVTransferService | None,
    path: str,
    body: dict[str, Any],
    headers: Any,
    requests: list[Any],
) -> None:
    """Give the engine requests of one API call what P/D asks of them (see module doc).

    Only a call with one engine request (one prompt, ``n`` 1) is disaggregated; the
    header is ignored for others (they prefill locally), and ``kv_transfer_params`` on
    them is a :class:`BadKVParams`.
    """
    if service is None:
        check_without_transfer(body)
        return
    if len(requests) != 1:
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and (
            params.get("do_remote_decode") or params.get("do_remote_prefill")
        ):
            raise BadKVParams("kv_transfer_params needs a single prompt and n = 1")
        return
    request = requests[0]
    prepared = await service.prepare(path, body, headers, request.request_id)
    request.kv_transfer_params = prepared.params
    request.kv_payload = prepared.payload


class KVTransferCollector(Collector):
    """P/D counters, read at scrape time (nothing to update per request)."""

    def __init__(self, service: KVTransferService, model_name: str) -> None:
        self.service = service
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["model_name"]
        s = self.service.transfer.stats
        held = CounterMetricFamily(
            "infergate:kv_transfer_prefills_held",
            "Prefills held for a decode engine (do_remote_decode), and how they ended.",
            labels=[*labels, "outcome"],
        )
        held.add_metric([self.model_name, "held"], s.held)
        held.add_metric([self.model_name, "pulled"], s.pulled)
        held.add_metric([self.model_name, "expired"], s.expired)
        yield held
        gauge = GaugeMetricFamily(
            "infergate:kv_transfer_held_blocks",
            "KV blocks held for decode engines right now.",
            labels=labels,
        )
        gauge.add_metric([self.model_name], self.service.transfer.held_blocks())
        yield gauge
        remote = CounterMetricFamily(
            "infergate:kv_transfer_remote_prefills",
            "Requests this engine decoded after a remote prefill (pulled) or prefilled "
            "itself because the remote prefill or the pull failed (fallback).",
            labels=[*labels, "outcome"],
        )
        o = self.service.prefiller.outcomes if self.service.prefiller else None
        remote.add_metric([self.model_name, "pulled"], o.pulled if o else 0)
        remote.add_metric([self.model_name, "fallback"], (o.fallback if o else 0) + s.rejected)
        yield remote
        tokens = CounterMetricFamily(
            "infergate:kv_transfer_injected_tokens",
            "Prompt tokens whose KV was pulled from a prefill engine and committed here.",
            labels=labels,
        )
        tokens.add_metric([self.model_name], s.injected_tokens)
        yield tokens
