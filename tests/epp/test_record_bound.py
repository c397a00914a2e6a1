"""A 2xx response whose completion record never arrives: the endpoint's in-flight count
follows the engine's own running + waiting counts, not a 330 s timeout.

A real simulated engine serves ``/metrics``; the ext-proc stream is driven by hand, so
the routed request never reaches the engine and its record never comes (as when PUB/SUB
drops it).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.types import Endpoint

from infergate.procs import free_port, http_ready

from .conftest import Stream, body, eventually, headers, response_headers, route_buffered

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}


async def _awaited_response(epp, channel) -> str:
    """Route one request, answer 200 and end the stream (engine accounting): its key."""
    stream = Stream(channel)
    await stream.send(headers(POST), body(b'{"model":"tiny","prompt":"hi"}'))
    header_response, _ = await stream.recv(2)
    key = {
        h.header.key: h.header.raw_value.decode()
        for h in header_response.request_headers.response.header_mutation.set_headers
    }["x-infergate-request-id"]
    await stream.send(response_headers({":status": "200", "content-type": "text/event-stream"}))
    await stream.recv(1)
    await stream.close()
    await eventually(lambda: key in epp.ext_proc.awaiting, timeout=10)
    return key


async def _skipped_response(channel) -> str:
    """Route one buffered request whose response headers the EPP skips, then end the
    stream without a response (Envoy's 503 after a failed upstream): its key."""
    stream = Stream(channel)
    headers_answer, key = await route_buffered(stream, POST, b'{"model":"tiny","prompt":"hi"}')
    skip = processing_mode_pb2.ProcessingMode.SKIP
    assert headers_answer.mode_override.response_header_mode == skip
    await stream.close()
    return key


async def test_a_lost_record_is_bounded_by_the_engines_counts(
    processes, infergate_cli, tiny_model: Path, epp_factory, channel_for
) -> None:
    port = free_port()
    processes.start(
        "engine-counts",
        [
            *infergate_cli, "engine", "serve", str(tiny_model), "--port", str(port),
            "--served-model-name", "tiny", "--simulate", "--max-model-len", "4096",
            "--num-gpu-blocks-override", "512",
        ],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    # Labelled as reporting completions on a port where nothing publishes.
    engine = Endpoint("127.0.0.1", port, ((COMPLETION_EVENTS_PORT_LABEL, str(free_port())),))
    epp = await epp_factory(static_endpoints=[engine])
    state = epp.datastore.get(engine.key)
    assert state is not None
    await eventually(lambda: state.metrics.updated_at > 0, timeout=30)
    lost = epp.metrics.requests.labels("record_lost")
    lost_before = lost._value.get()

    # 1. While the engine really runs one request, one awaited response may be live: kept.
    long = {"model": "tiny", "prompt": "go", "max_tokens": 3000, "ignore_eos": True}
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", url, json={**long, "stream": True}) as running,
    ):
        assert running.status_code == 200
        await eventually(lambda: state.metrics.running >= 1, timeout=30)
        key = await _awaited_response(epp, channel_for(epp))
        assert state.in_flight_requests == 1
        checks = 0
        for _ in range(30):  # several expiry sweeps (1 s apart) while it runs
            await asyncio.sleep(0.1)
            if state.metrics.running >= 1 and state.metrics.updated_at > 0:
                checks += 1
            assert key in epp.ext_proc.awaiting
        assert checks > 0 and state.metrics.running >= 1, "the generation ended too soon"
    # 2. The client hangs up; the engine's counts drop to zero: given up, in seconds.
    await eventually(lambda: key not in epp.ext_proc.awaiting, timeout=20)
    assert state.in_flight_requests == 0
    assert lost._value.get() == lost_before + 1

    # 3. An idle engine: a fresh awaited response is given up too (no 330 s wait).
    key = await _awaited_response(epp, channel_for(epp))
    assert state.in_flight_requests == 1
    await eventually(lambda: key not in epp.ext_proc.awaiting, timeout=20)
    assert state.in_flight_requests == 0
    assert not epp.ext_proc.routed

    # 4. Response headers skipped (buffered body) and the upstream failed: no status, no
    #    record; the counts give it up as well.
    key = await _skipped_response(channel_for(epp))
    await eventually(lambda: key in epp.ext_proc.awaiting, timeout=10)
    assert state.in_flight_requests == 1
    await eventually(lambda: key not in epp.ext_proc.awaiting, timeout=20)
    assert state.in_flight_requests == 0
    assert lost._value.get() == lost_before + 3


async def _countless_metrics_server() -> tuple[asyncio.Server, int]:
    """A live /metrics that names none of the engine families (a server of a dialect the
    EPP does not read): scrapes succeed, so the endpoint is alive, yet it has no counts."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                page = b"# nothing the EPP counts\nx 1\n"
                head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(page)}\r\n\r\n"
                writer.write(head.encode() + page)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_an_endpoint_without_counts_is_not_judged(epp_factory, channel_for) -> None:
    """Alive (its /metrics answers) but without running/waiting counts: nothing to bound
    by, so the awaited response stays in flight (until the 330 s timeout or the endpoint
    leaving). An endpoint whose port refuses is dead instead: tests/epp/test_dead_endpoint.py."""
    server, port = await _countless_metrics_server()
    async with server:
        dark = Endpoint("127.0.0.1", port, ((COMPLETION_EVENTS_PORT_LABEL, str(free_port())),))
        epp = await epp_factory(static_endpoints=[dark])
        state = epp.datastore.get(dark.key)
        assert state is not None
        key = await _awaited_response(epp, channel_for(epp))
        for _ in range(35):  # three expiry sweeps or more
            await asyncio.sleep(0.1)
            assert key in epp.ext_proc.awaiting and state.in_flight_requests == 1
        assert state.metrics.running == 0 and state.metrics.waiting == 0
