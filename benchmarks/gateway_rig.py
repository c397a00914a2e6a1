"""Rig for the EPP overhead and throughput benchmarks (benchmarks/epp_*.py import it as
``gateway_rig``: a script's own folder is first on its path).

Two real Envoys in front of the same upstream: the gateway (ext_proc to a real
``infergate epp``, the pool cluster on its pick) and a direct twin with the identical listener
and timeouts but no ext_proc filter. The upstream is, by default, a third Envoy answering
``/v1/completions`` and ``/metrics`` (vLLM metric names) from ``direct_response`` on
several ports: a fixed, tiny latency, so the difference between the two paths is the
EPP's cost and nothing else. ``--upstream engine`` uses ``infergate engine serve
--simulate`` processes instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import yaml
from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.options import EPP_PORTS, EppOptions

from infergate.bench.metrics import arrival_times
from infergate.bench.routing.routers import direct_twin
from infergate.envoy.bootstrap import EnvoyConfig, build_envoy_config
from infergate.envoy.process import start_envoy
from infergate.procs import ProcessGroup, free_port, http_ready
from infergate.stack.local import (
    LOOPBACK,
    ensure_tiny_model,
    grpc_serving,
    infergate_argv,
)
from infergate.wire.completions import CompletionBatch, CompletionRecord, owner, records_topic
from infergate.wire.kv_events import encode_seq
from infergate.wire.names import REQUEST_ID_HEADER, SERVED_HEADER

MODEL = "bench"
COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)
CHAT_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)
METRICS = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1\n'
)


def _direct(status: int, body: str, content_type: str) -> dict[str, Any]:
    return {
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {"header": {"key": "content-type", "value": content_type}},
            # The EPP's request key back to the client, which may publish the request's
            # completion record as an engine would (benchmarks/epp_overhead.py --records).
            {"header": {"key": REQUEST_ID_HEADER, "value": f"%REQ({REQUEST_ID_HEADER})%"}},
        ],
    }


def static_upstream_config(ports: Sequence[int], admin_port: int) -> dict[str, Any]:
    """An Envoy that answers like a tiny vLLM on every port in ``ports``."""
    routes = [
        {"match": {"prefix": "/metrics"}, **_direct(200, METRICS, "text/plain; version=0.0.4")},
        {"match": {"prefix": "/health"}, **_direct(200, "", "text/plain")},
        {"match": {"prefix": "/v1/completions"}, **_direct(200, COMPLETION, "application/json")},
        {
            "match": {"prefix": "/v1/chat/completions"},
            **_direct(200, CHAT_COMPLETION, "application/json"),
        },
    ]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    listeners = [
        {
            "name": f"upstream_{port}",
            "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": hcm,
                        }
                    ]
                }
            ],
        }
        for port in ports
    ]
    return {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": admin_port}}},
        "static_resources": {"listeners": listeners},
    }


@dataclass
class Rig:
    gateway_url: str
    direct_url: str
    epp_metrics_url: str
    epp_pid: int
    group: ProcessGroup = field(repr=False)
    #: Every EPP replica's pid (``epp_pid`` first).
    epp_pids: list[int] = field(default_factory=list)


def start_rig(
    group: ProcessGroup,
    workdir: Path,
    *,
    upstream: str = "static",
    endpoints: int = 4,
    envoy_concurrency: int = 1,
    response_bodies: bool = True,
    observe_responses: bool = True,
    response_accounting: str | None = None,
    epp_args: Sequence[str] = (),
    bootstrap: dict[str, Any] | None = None,
    epp_replicas: int = 1,
) -> Rig:
    """``response_accounting`` (``build_envoy_config``'s) wins over the two older flags;
    with ``engine`` and ``upstream="engine"`` the engines publish completion records."""
    if response_accounting is None:
        response_accounting = (
            "none" if not response_bodies else "observer" if observe_responses else "body"
        )
    ports = [free_port() for _ in range(endpoints)]
    done_ports = [free_port() for _ in range(endpoints)]
    reporting = upstream == "engine" and response_accounting == "engine"
    if upstream == "static":
        start_envoy(
            group,
            static_upstream_config(ports, free_port()),
            workdir / "upstream.yaml",
            name="upstream",
        )
    elif upstream == "engine":
        model = ensure_tiny_model()
        for i, port in enumerate(ports):
            group.start(
                f"engine-{i}",
                [
                    *infergate_argv(),
                    "engine",
                    "serve",
                    str(model),
                    "--simulate",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--served-model-name",
                    MODEL,
                    *(["--completion-events-port", str(done_ports[i])] if reporting else []),
                ],
                ready=http_ready(f"http://{LOOPBACK}:{port}/health"),
                timeout=120,
            )
    else:
        raise ValueError(f"--upstream must be static or engine, not {upstream!r}")

    endpoints_file = workdir / "endpoints.yaml"
    endpoints_file.write_text(
        yaml.safe_dump(
            {
                "endpoints": [
                    {
                        "address": LOOPBACK,
                        "port": port,
                        "labels": {COMPLETION_EVENTS_PORT_LABEL: str(done)} if reporting else {},
                    }
                    for port, done in zip(ports, done_ports, strict=True)
                ]
            }
        )
    )
    replicas = []  # (process, gRPC port, metrics port): several replicas behind one cluster
    for index in range(epp_replicas):
        grpc, health, metrics = free_port(), free_port(), free_port()
        options = EppOptions(
            endpoints_file=endpoints_file, host=LOOPBACK, log_level="warning",
            grpc_port=grpc, grpc_health_port=health, metrics_port=metrics,
        )  # fmt: skip
        argv = [*infergate_argv(), *options.argv(always=EPP_PORTS), *epp_args]
        name = f"epp-{index}" if index else "epp"
        process = group.start(name, argv, ready=grpc_serving(LOOPBACK, health), timeout=120)
        replicas.append((process, grpc, metrics))
    epp, grpc, metrics = replicas[0]

    gateway_port, direct_port = free_port(), free_port()
    common: dict[str, Any] = {
        "listen_address": LOOPBACK,
        "epp_address": LOOPBACK,
        "epp_port": grpc,
        "epp_replicas": [(LOOPBACK, port) for _, port, _ in replicas[1:]],
        "fallback_endpoints": [(LOOPBACK, p) for p in ports],
        "access_log": False,
        "response_accounting": response_accounting,
        **(bootstrap or {}),
    }
    start_envoy(
        group,
        build_envoy_config(EnvoyConfig(listen_port=gateway_port, admin_port=free_port(), **common)),
        workdir / "gateway.yaml",
        name="envoy-gateway",
        concurrency=envoy_concurrency,
    )
    start_envoy(
        group,
        direct_twin(
            build_envoy_config(
                EnvoyConfig(listen_port=direct_port, admin_port=free_port(), **common)
            )
        ),
        workdir / "direct.yaml",
        name="envoy-direct",
        concurrency=envoy_concurrency,
    )
    return Rig(
        gateway_url=f"http://{LOOPBACK}:{gateway_port}/v1/completions",
        direct_url=f"http://{LOOPBACK}:{direct_port}/v1/completions",
        epp_metrics_url=f"http://{LOOPBACK}:{metrics}/metrics",
        epp_pid=epp.pid,
        group=group,
        epp_pids=[process.pid for process, _, _ in replicas],
    )


BODY: dict[str, Any] = {"model": MODEL, "prompt": "Say ok.", "max_tokens": 1, "stream": False}
_JSON = {"content-type": "application/json"}


def body_of_size(prompt_bytes: int) -> dict[str, Any]:
    """:data:`BODY` with a prompt of about ``prompt_bytes`` (2 KB, 220 KB in the figures)."""
    if prompt_bytes <= len(BODY["prompt"]):
        return BODY
    words = "the quick brown fox jumps over a lazy dog " * (prompt_bytes // 42 + 1)
    return {**BODY, "prompt": words[:prompt_bytes]}


#: Called with each successful response's headers (after its latency was taken).
OnResponse = Callable[[Mapping[str, str]], None]


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any] | bytes,
    on_response: OnResponse | None = None,
) -> float | None:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.perf_counter()
    try:
        async with session.post(url, data=payload, headers=_JSON) as response:
            await response.read()
            if response.status != 200:
                return None
    except (aiohttp.ClientError, TimeoutError):
        return None
    latency = time.perf_counter() - start
    if on_response is not None:
        on_response(response.headers)
    return latency


async def open_loop(
    url: str,
    rate: float,
    seconds: float,
    *,
    seed: int = 0,
    body: dict[str, Any] | None = None,
    on_response: OnResponse | None = None,
) -> dict[str, float]:
    """Poisson arrivals at ``rate`` for ``seconds``; latency percentiles (ms) of successes."""
    payload = json.dumps(body or BODY).encode()  # encoded once: the client's CPU is shared
    n = max(1, int(rate * seconds))
    offsets = arrival_times(n, rate, seed=seed)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        for _ in range(50):  # warm connections and the EPP's code paths
            await _one(session, url, payload, on_response)
        started = time.perf_counter()
        tasks = []
        lag = []
        for offset in offsets:
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag.append(-delay)
            tasks.append(asyncio.create_task(_one(session, url, payload, on_response)))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    ok = [r for r in results if r is not None]
    ms = np.asarray(ok or [0.0]) * 1000
    return {
        "sent": n,
        "ok": len(ok),
        "achieved_rps": len(ok) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(statistics.fmean(ms)),
        "send_lag_p99_ms": float(np.percentile(np.asarray(lag or [0.0]) * 1000, 99)),
    }


async def closed_loop(
    url: str,
    concurrency: int,
    seconds: float,
    body: dict[str, Any] | None = None,
    on_response: OnResponse | None = None,
) -> dict[str, float]:
    """``concurrency`` clients back to back for ``seconds``: the sustained request rate."""
    payload = json.dumps(body or BODY).encode()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    latencies: list[float] = []
    failures = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        for _ in range(50):
            await _one(session, url, payload, on_response)
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal failures
            while time.perf_counter() < deadline:
                latency = await _one(session, url, payload, on_response)
                if latency is None:
                    failures += 1
                else:
                    latencies.append(latency)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ms = np.asarray(latencies or [0.0]) * 1000
    return {
        "concurrency": concurrency,
        "rps": len(latencies) / elapsed,
        "failures": failures,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def process_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds used so far by ``pid`` and its live children (``--workers``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) / ticks
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return own + sum(process_cpu_seconds(int(child)) for child in children)


class RecordPublisher:
    """Completion records for the static upstream, published as an engine publishes them.

    Why: a ``direct_response`` Envoy cannot publish records, and without them the EPP
    cannot skip the response headers (``StreamState._skips_response_headers``). The
    upstream echoes the EPP's request key; the client, once a response is read, sends
    that request's record (status 200, the canned usage) on a PUB socket per upstream
    port, the one Envoy served it from. :attr:`labels` are the endpoints-file labels
    that point the EPP at them. A record leaves after the response, as the engine's does.
    """

    def __init__(self, ports: Sequence[int]) -> None:
        import zmq

        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        #: Upstream port -> the endpoints-file labels of that endpoint.
        self.labels: dict[int, dict[str, str]] = {}
        for port in ports:
            socket = self._context.socket(zmq.PUB)
            published = socket.bind_to_random_port(f"tcp://{LOOPBACK}")
            self._sockets[f"{LOOPBACK}:{port}"] = socket
            self.labels[port] = {COMPLETION_EVENTS_PORT_LABEL: str(published)}
        self._encoder = msgspec.msgpack.Encoder()
        self.sent = 0  #: records sent so far (also each batch's sequence number)

    def __call__(self, headers: Mapping[str, str]) -> None:
        key = headers.get(REQUEST_ID_HEADER)
        socket = self._sockets.get(headers.get(SERVED_HEADER, ""))
        if not key or socket is None:
            return  # not routed by an EPP that keys its requests (the direct twin, a peer)
        now = time.time()
        record = CompletionRecord(key, 200, 8, 1, 0, now)
        self.sent += 1
        payload = self._encoder.encode(CompletionBatch(now, [record]))
        topic = records_topic(owner(key))  # the routing replica's topic, as an engine's
        socket.send_multipart((topic, encode_seq(self.sent), payload))

    def close(self) -> None:
        self._context.destroy(linger=0)
