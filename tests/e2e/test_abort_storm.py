"""An abort storm beside steady load: other clients' requests are not hurt (issue 45 item 3).

Through the real Envoy (one worker, so one HTTP/2 connection to the EPP carries every
ext-proc stream), the EPP over TLS as ``infergate up`` runs it, and simulated engines.
200 clients each open a request and drop their connection mid-request or mid-stream,
all at once, while a steady client sends about 8 requests a second. Each abort makes
Envoy reset its ext-proc stream, often in the same read as the stream's opening: with
the ``h2`` crate's default limit (20 such resets pending acceptance) the EPP answered
the burst with GOAWAY ENHANCE_YOUR_CALM, and every stream on the connection, the steady
client's included, failed (FailClose's 500). Three runs, each must give the steady
client only 200s.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.stack.local import LOOPBACK, LocalStack, StackSpec

ABORTS = 200
STEADY_INTERVAL_S = 0.125  # about 8 requests a second
RUNS = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        secure_serving=True,  # `up`'s default
        engine_args=["--sim-base-ms", "10"],
        access_log=False,
        workdir=tmp_path_factory.mktemp("abort-storm"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def _request(body: dict[str, object], content_length: int | None = None) -> bytes:
    payload = json.dumps(body).encode()
    length = len(payload) if content_length is None else content_length
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    return head.encode() + payload


async def _abort(port: int, index: int, go: asyncio.Event) -> None:
    """One client that drops its connection: half before their body has ended (the
    EPP is still waiting for it to route), half once their response is streaming."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    body = {"model": "tiny", "prompt": f"abort {index}", "max_tokens": 64, "stream": True}
    try:
        if index % 2:
            data = _request(body, content_length=len(json.dumps(body)) + 100)  # body cut
            await go.wait()
            writer.write(data)
            await writer.drain()
        else:
            await go.wait()
            writer.write(_request(body))
            await writer.drain()
            await asyncio.wait_for(reader.read(1), timeout=10)  # the response has begun
    except (OSError, TimeoutError):
        pass
    finally:
        writer.transport.abort()  # no goodbye: the connection is just gone


async def _storm(port: int) -> None:
    go = asyncio.Event()
    clients = [asyncio.ensure_future(_abort(port, i, go)) for i in range(ABORTS)]
    await asyncio.sleep(0.5)  # every connection open, then all requests at once
    go.set()
    await asyncio.gather(*clients, return_exceptions=True)


def _steady(stack: LocalStack, stop: threading.Event, statuses: list[int]) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                response = client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "steady", "max_tokens": 8},
                )
                statuses.append(response.status_code)
            except httpx.HTTPError:
                statuses.append(0)
            stop.wait(max(0.0, STEADY_INTERVAL_S - (time.monotonic() - started)))


@pytest.mark.parametrize("run", range(RUNS))
def test_an_abort_storm_fails_no_request_of_a_steady_client(stack: LocalStack, run: int) -> None:
    assert stack.epp is not None and stack.epp.log_path is not None
    log_before = stack.epp.log_path.stat().st_size
    statuses: list[int] = []
    stop = threading.Event()
    steady = threading.Thread(target=_steady, args=(stack, stop, statuses))
    steady.start()
    try:
        time.sleep(1.0)  # steady load first
        asyncio.run(_storm(stack.spec.port))
        time.sleep(1.5)  # and after: a dropped connection fails what comes next too
    finally:
        stop.set()
        steady.join(60)
    assert len(statuses) >= 8
    failed = [status for status in statuses if status != 200]
    assert not failed, f"run {run}: {len(failed)} of {len(statuses)} steady requests failed"
    assert stack.epp.alive()
    with stack.epp.log_path.open("rb") as log:
        log.seek(log_before)
        assert b"protocol error" not in log.read()  # the connection was never dropped
