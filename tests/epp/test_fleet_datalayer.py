"""Issue 21, the data layer at fleet scale: pushed load reports instead of scrapes, a
1,000-endpoint discovery file, and load reports that cannot hurt the EPP."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from infergate.epp.app import Epp
from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.datalayer.load_reports import push_alive
from infergate.epp.types import Endpoint, Metrics

from infergate.procs import ProcessGroup, free_port, http_ready
from infergate.wire import load

from .conftest import EppFactory, eventually


def _report(**changes: Any) -> load.LoadReport:
    fields: dict[str, Any] = dict(
        sent_at=time.time(), tick=0.01, heartbeat=0.5, waiting=0, running=0, kv_usage=0.0,
        block_size=16, num_gpu_blocks=1024, max_lora=0, running_adapters=[],
        waiting_adapters=[], prefill_seconds_sum=0.0, prefill_count=0.0,
        prompt_tokens_total=0.0, prefix_hits_total=0.0, prefix_queries_total=0.0,
    )  # fmt: skip
    fields.update(changes)
    return load.LoadReport(**fields)


def _engine(processes: ProcessGroup, model: Path, name: str, *extra: str) -> tuple[Any, int, int]:
    port, events_port = free_port(), free_port()
    process = processes.start(
        name,
        [sys.executable, "-m", "infergate.cli", "engine", "serve", str(model), "--simulate",
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
         "--completion-events-port", str(events_port), *extra],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    return process, port, events_port


async def test_load_reports_replace_scraping_and_stop_when_the_engine_dies(
    processes: ProcessGroup, tiny_model: Path, epp_factory: EppFactory
) -> None:
    """A real engine with --completion-events-port pushes its load; the EPP stops scraping
    it and reads its queue from the reports. A second real engine, seen without the
    port label (as a vLLM pod that cannot push), is scraped as before. SIGKILL the
    pushing engine: its reports stop and the endpoint goes stale, as a failed scrape's."""
    pusher, push_port, events_port = _engine(
        processes, tiny_model, "engine-push", "--load-report-heartbeat", "0.3"
    )
    _, scraped_port, _ = _engine(processes, tiny_model, "engine-scraped")
    pushing = Endpoint("127.0.0.1", push_port, ((COMPLETION_EVENTS_PORT_LABEL, str(events_port)),))
    scraped = Endpoint("127.0.0.1", scraped_port)
    epp: Epp = await epp_factory(static_endpoints=[pushing, scraped])
    push_state, scraped_state = epp.datastore.get(pushing.key), epp.datastore.get(scraped.key)
    assert push_state is not None and scraped_state is not None

    await eventually(lambda: push_state.metrics.pushed and scraped_state.metrics.updated_at > 0)
    assert push_state.metrics.block_size == 16 and push_state.metrics.num_gpu_blocks > 0
    assert push_state.metrics.heartbeat == 0.3
    assert not scraped_state.metrics.pushed  # no label: scraped, exactly as before
    reports = epp.load_reports.received
    scraped_at = scraped_state.metrics.updated_at
    for _ in range(30):  # five heartbeats: a scrape of the pusher would replace its snapshot
        await asyncio.sleep(0.05)
        assert push_state.metrics.pushed
    assert epp.load_reports.received >= reports + 2
    assert scraped_state.metrics.updated_at > scraped_at  # the unlabelled one is scraped

    # Load moves through the reports: a long stream runs on the pushing engine.
    async with httpx.AsyncClient(timeout=60) as client:
        request = asyncio.create_task(
            client.post(
                f"http://127.0.0.1:{push_port}/v1/completions",
                json={"model": "m", "prompt": "hello", "max_tokens": 400, "ignore_eos": True},
            )
        )
        await eventually(lambda: push_state.metrics.running == 1)
        assert push_state.metrics.pushed
        response = await request
        assert response.status_code == 200
    await eventually(lambda: push_state.metrics.running == 0)

    os.kill(pusher.pid, signal.SIGKILL)
    pusher.popen.wait(timeout=10)
    killed_at = time.monotonic()
    await eventually(lambda: epp.saturation.is_stale(push_state), timeout=10)
    # Stale after the staleness threshold since the last report, not before.
    assert time.monotonic() - killed_at > epp.saturation.staleness - 0.6
    received = epp.load_reports.received
    failures = epp.collectors.failures
    await asyncio.sleep(0.5)
    assert epp.load_reports.received == received
    assert epp.collectors.failures > failures  # the fallback scrape fails too
    assert not epp.saturation.is_stale(scraped_state)


async def test_a_scrape_asks_for_the_samples_it_reads_and_parses_them_the_same(
    processes: ProcessGroup, tiny_model: Path, epp_factory: EppFactory
) -> None:
    """The collector asks ``/metrics?name[]=…`` for the dialect's samples. A real engine
    answers with those alone (as vLLM's prometheus_client app does), a twentieth of the
    page, and it parses to the same snapshot as the whole page; the fake fleet answers
    the same query the same way. The EPP scraping that engine receives small pages."""
    from infergate.epp.datalayer.dialects import VLLM, parse_metrics

    from tests.support.fake_fleet import FakeFleet

    _, port, _ = _engine(processes, tiny_model, "engine")
    url = f"http://127.0.0.1:{port}/metrics"
    async with httpx.AsyncClient() as client:
        full = (await client.get(url)).content
        small = (await client.get(f"{url}?{VLLM.query()}")).content
    assert len(small) * 10 < len(full)
    assert b"_bucket" not in small and b"vllm:num_requests_running" in small

    def fields(page: bytes) -> dict[str, Any]:
        snapshot = parse_metrics(page, VLLM)
        return {k: getattr(snapshot, k) for k in snapshot.__dataclass_fields__ if k != "updated_at"}

    assert fields(small) == fields(full)
    assert fields(full)["num_gpu_blocks"] > 0 and fields(full)["counts_reported"]
    fleet = FakeFleet(1)
    fake_full = fleet.metrics_response(b"", 0)
    fake_small = fleet.metrics_response(VLLM.query().encode(), 0)
    assert len(fake_small) * 10 < len(fake_full)
    assert fields(fake_small.split(b"\r\n\r\n", 1)[1]) == fields(fake_full.split(b"\r\n\r\n", 1)[1])

    epp: Epp = await epp_factory(static_endpoints=[Endpoint("127.0.0.1", port)])
    await eventually(lambda: epp.collectors.scrapes >= 5)
    children = epp.metrics._datalayer_children
    updates = sum(children[s][0]._value.get() for s in ("scrape", "scrape_unchanged"))
    received = sum(children[s][1]._value.get() for s in ("scrape", "scrape_unchanged"))
    assert updates >= 5 and received / updates < 4096  # the filtered page, not ~30 KB


async def test_a_thousand_endpoint_file_is_loaded_and_watched(
    tmp_path: Path, epp_factory: EppFactory
) -> None:
    """1,000 endpoints from --endpoints: all in the pool with one scrape loop each;
    edits (removals, additions, a relabel) are picked up, and the per-endpoint state of
    removed endpoints goes with them."""
    import yaml

    def write(entries: list[dict[str, Any]]) -> None:
        tmp = tmp_path / "endpoints.yaml.tmp"
        tmp.write_text(yaml.safe_dump({"endpoints": entries}))
        tmp.replace(tmp_path / "endpoints.yaml")

    entries = [{"address": f"10.{i // 250}.{i % 250}.1", "port": 8000} for i in range(1000)]
    write(entries)
    # An hour between scrapes: the loops exist, but nothing dials 10.x during the test.
    epp: Epp = await epp_factory(
        endpoints_file=tmp_path / "endpoints.yaml", refresh_metrics_interval=3600.0
    )
    assert len(epp.datastore) == 1000
    await eventually(lambda: len(epp.collectors._tasks.tasks) == 1000)

    changed = entries[10:] + [{"address": "10.9.9.9", "port": 8000 + i} for i in range(5)]
    changed[0] = {**changed[0], "labels": {"inference.networking.k8s.io/engine-type": "sglang"}}
    write(changed)
    await eventually(lambda: len(epp.datastore) == 995)
    assert epp.datastore.get("10.0.0.1:8000") is None
    assert epp.datastore.get("10.9.9.9:8004") is not None
    relabelled = epp.datastore.get(f"10.0.{10}.1:8000")
    assert (
        relabelled is not None
        and relabelled.endpoint.label("inference.networking.k8s.io/engine-type") == "sglang"
    )
    await eventually(lambda: len(epp.collectors._tasks.tasks) == 995)
    assert set(epp.collectors._tasks.tasks) == {s.key for s in epp.datastore.all()}


def _bad_payloads() -> list[bytes]:
    good = msgspec.msgpack.decode(load.encode(_report()))
    out = [b"", b"\x00garbage\xff" * 10, msgspec.msgpack.encode({"waiting": 1})]
    for index, value in [
        (3, -1),  # negative queue
        (3, 10**15),  # a queue no engine holds
        (5, float("nan")),
        (5, 7.5),  # KV usage above 1
        (13, float("inf")),
        (3, "three"),  # wrong type
        (9, ["a" * 300]),  # adapter name too long
        (9, ["x"] * 5000),  # too many adapters
        (1, 0.0),  # tick 0
        (16, -5.0),  # negative pending prefill
        (16, float("nan")),
        (16, 1e19),  # more prompt tokens than any engine holds
    ]:
        bad = list(good)
        bad[index] = value
        out.append(msgspec.msgpack.encode(bad))
    out.append(msgspec.msgpack.encode(good[:5]))  # fields missing
    return out


async def test_bad_or_flooding_load_reports_cannot_crash_or_bloat_the_epp(
    epp_factory: EppFactory,
) -> None:
    """Garbage, wrong types, out-of-range values, an oversized frame and a flood of
    reports from one "engine" (a ZMQ PUB this test owns): each bad report is dropped and
    counted, the last good snapshot stands, the EPP keeps taking good reports, and
    memory does not grow with the number of reports. Reports are read when the EPP
    refreshes its view (before a decision): each check here refreshes first."""
    import resource

    events_port = free_port()
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{events_port}")
    endpoint = Endpoint(
        "127.0.0.1", free_port(), ((COMPLETION_EVENTS_PORT_LABEL, str(events_port)),)
    )
    epp: Epp = await epp_factory(static_endpoints=[endpoint], refresh_metrics_interval=3600.0)
    state = epp.datastore.get(endpoint.key)
    assert state is not None
    seq = iter(range(10**9))

    def send(payload: bytes) -> None:
        pub.send_multipart([load.TOPIC, next(seq).to_bytes(8, "big"), payload])

    def refreshed(check: Any) -> Any:
        def after_refresh() -> Any:  # reports are read when the view is refreshed
            epp.datastore.refresh()
            return check()

        return after_refresh

    async def send_until(check: Any, report: load.LoadReport) -> None:
        """PUB drops what is sent before the SUB (re)connects: resend until seen."""
        deadline = time.monotonic() + 20
        while not refreshed(check)():
            assert time.monotonic() < deadline, "report never applied"
            send(load.encode(report))
            await asyncio.sleep(0.05)

    await send_until(lambda: state.metrics.waiting == 2, _report(waiting=2))
    good = state.metrics
    bad = _bad_payloads()
    for count, payload in enumerate(bad, 1):  # one at a time: only the newest is read
        send(payload)
        await eventually(refreshed(lambda n=count: epp.load_reports.rejected >= n))
    assert state.metrics is good  # nothing bad replaced the snapshot

    # A flood: 50,000 reports as fast as the socket takes them.
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    received = epp.load_reports.received
    for i in range(50_000):
        send(load.encode(_report(waiting=i % 7, running=i % 5)))
        if i % 1000 == 0:
            await asyncio.sleep(0)  # let the EPP's loop run, as a separate process would
    await send_until(lambda: state.metrics.waiting == 42, _report(waiting=42))
    assert epp.load_reports.received > received
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 64, f"peak RSS grew {grown_mb:.0f} MB over a 50k-report flood"
    assert len(epp.load_reports._bad) <= 1

    # A frame over the subscriber's size cap: ZMQ cuts that peer off rather than buffer
    # it. The engine's push stream then counts as stopped, and the endpoint falls back to
    # being scraped (it stays in the pool).
    send(b"\x00" * (9 << 20))
    await eventually(refreshed(lambda: not push_alive(state.metrics, time.monotonic())), 10)
    assert epp.datastore.get(endpoint.key) is state
    pub.close(0)


def test_a_report_without_the_prefill_fields_decodes_them_as_zero() -> None:
    """Engines from before each field (their reports one or two elements shorter) still
    decode: pending prefill, then waiting prefill, read as 0."""
    report = _report(prefill_pending_tokens=300.0, prefill_waiting_tokens=120.0)
    full = msgspec.msgpack.decode(load.encode(report))
    assert len(full) == 18 and full[16] == 300.0 and full[17] == 120.0
    decoded = load.decode(msgspec.msgpack.encode(full))
    assert decoded.prefill_pending_tokens == 300.0 and decoded.prefill_waiting_tokens == 120.0
    older = load.decode(msgspec.msgpack.encode(full[:17]))
    assert older.prefill_pending_tokens == 300.0 and older.prefill_waiting_tokens == 0.0
    oldest = load.decode(msgspec.msgpack.encode(full[:16]))
    assert oldest.prefill_pending_tokens == 0.0 and oldest.prefill_waiting_tokens == 0.0


def test_pushed_snapshot_freshness_and_push_liveness() -> None:
    """While heartbeats arrive, a pushed snapshot is as fresh as the engine's tick (it is
    dated when the engine sent it); once they stop, it ages like a scrape (and the
    collector resumes)."""
    from infergate.epp.datalayer.load_reports import snapshot

    report = _report(tick=0.01, heartbeat=0.5)
    pushed = snapshot(report, now=100.0, wall=report.sent_at + 0.002)
    assert pushed.pushed and pushed.updated_at == pytest.approx(99.998, abs=1e-5)
    assert pushed.freshness(100.4) == pytest.approx(0.01)
    assert pushed.freshness(100.005) == pytest.approx(0.007, abs=1e-5)
    assert pushed.freshness(101.0) == pytest.approx(1.002, abs=1e-5)  # heartbeats late
    assert push_alive(pushed, 101.2) and not push_alive(pushed, 101.3)
    scraped = Metrics(updated_at=100.0)
    assert not scraped.pushed and scraped.freshness(100.04) == pytest.approx(0.04)
    skewed = snapshot(report, now=100.0, wall=report.sent_at + 999)  # clocks disagree
    assert skewed.updated_at == 99.5  # counted within a heartbeat only


def test_engine_reporter_sends_on_change_and_heartbeat() -> None:
    """The engine's reporter coalesces changes per tick and heartbeats when idle."""
    from infergate.engine.load_reports import LoadReporter

    state = [0]
    sent: list[load.LoadReport] = []
    reporter = LoadReporter(
        lambda: (state[0], 0, 0.0, 16, 64, 0, [], [], 0.0, 0.0, 0.0, 0.0, 0.0),
        sent.append,
        tick=0.005,
        heartbeat=0.2,
    )
    reporter.start()
    try:
        deadline = time.monotonic() + 10
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        state[0] = 4
        while not any(r.waiting == 4 for r in sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(r.waiting == 4 for r in sent)
        count = len(sent)
        time.sleep(0.5)  # idle: heartbeats only, not one report per tick
        assert 1 <= len(sent) - count <= 4
        assert all(r.heartbeat == 0.2 and r.tick == 0.005 for r in sent)
    finally:
        reporter.close()
    with pytest.raises(ValueError):
        LoadReporter(lambda: (), sent.append, tick=1.0, heartbeat=0.5)


async def test_keep_alive_get_reuses_one_connection_and_survives_bad_servers() -> None:
    """The scrapers' HTTP client: one connection for many GETs; chunked bodies; a server
    that closes after each response, answers garbage, or never answers, costs one failed
    scrape each, and the next scrape dials again."""
    from infergate.epp.datalayer.http_get import HttpError, KeepAliveGet

    connections = 0
    mode = "ok"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if mode == "ok":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                elif mode == "chunked":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                    )
                elif mode == "close":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    )
                    await writer.drain()
                    writer.close()
                    return
                elif mode == "garbage":
                    writer.write(b"\x00\x01 not http at all\r\n\r\n")
                # "silent": never answer
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = KeepAliveGet("127.0.0.1", port, "/metrics", timeout=0.5)
    try:
        for _ in range(20):
            assert await client.get() == (200, b"hello")
        assert connections == 1
        mode = "chunked"
        assert await client.get() == (200, b"abcde")
        mode = "close"
        assert await client.get() == (200, b"ok")
        assert await client.get() == (200, b"ok")
        assert connections == 2  # the first closed after its answer, the second too
        mode = "garbage"
        with pytest.raises(HttpError):
            await client.get()
        mode = "silent"
        with pytest.raises(TimeoutError):
            await client.get()
        mode = "ok"
        assert await client.get() == (200, b"hello")
    finally:
        client.close()
        server.close()
    with pytest.raises(OSError):  # nothing listens any more
        await KeepAliveGet("127.0.0.1", free_port(), "/metrics", timeout=0.5).get()
