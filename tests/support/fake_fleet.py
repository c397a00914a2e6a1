"""A fake engine fleet in one process, for the fleet-scale lab and tests.

Hundreds to a thousand engines do not fit on a small machine; what the Endpoint Picker
sees of an idle engine does. Each fake engine is:

* an HTTP port answering ``GET /metrics`` with a real engine metrics page (rendered by
  the engine's own :class:`~infergate.engine.metrics.EngineMetrics`, vLLM's names,
  histograms included, ~30 KB; with ``name[]=…`` only those samples, as vLLM's
  prometheus_client app answers it), ``GET /v1/models`` and ``GET /health``;
* with ``push=True``, also a ZMQ PUB port sending load reports
  (:mod:`infergate.wire.load`) every heartbeat at a random phase, plus changed reports
  at ``changes_per_s`` across the fleet, as a real engine's completion-events port does.

With ``changing=True`` every scrape gets a page that differs from the one before (the
waiting and running gauges move), which is the costly case for the scraper. The HTTP
side is a plain asyncio protocol with prebuilt responses, so the fleet's own cost stays
small next to the EPP it feeds. ``write_endpoints_file`` writes the EPP's ``--endpoints``
file, with the completion-events port label for pushing engines.

    python tests/support/fake_fleet.py --endpoints 1000 --push --file /tmp/fleet.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import yaml

from infergate.wire import load

if TYPE_CHECKING:
    from infergate.engine.metrics import EngineMetrics

PAGE_VARIANTS = 16
PUSH_LABEL = "infergate.io/completion-events-port"


def _constant(value: float) -> Callable[[], float]:
    return lambda: value


def metrics_engines(
    variants: int, block_size: int = 16, num_gpu_blocks: int = 4096
) -> list[EngineMetrics]:
    """``variants`` engines' metrics that differ in their live gauges."""
    from infergate.engine.metrics import EngineMetrics

    engines = []
    for v in range(variants):
        m = EngineMetrics("model", block_size=block_size, num_gpu_blocks=num_gpu_blocks)
        m.bind(_constant(v % 4), _constant(v % 3), _constant(v / (2 * variants)))
        for i in range(40):  # histograms with counts, as a serving engine's are
            m.ttft.observe(0.01 * i)
            m.prefill_time.observe(0.005 * i)
            m.request_prompt_tokens.observe(200 + i)
            m.e2e.observe(0.5 + 0.01 * i)
        engines.append(m)
    return engines


def metrics_pages(variants: int, block_size: int = 16, num_gpu_blocks: int = 4096) -> list[bytes]:
    """``variants`` engine metrics pages that differ in their live gauges."""
    return [m.render() for m in metrics_engines(variants, block_size, num_gpu_blocks)]


def _response(body: bytes, content_type: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
    return head % (content_type, len(body)) + body


class _Http(asyncio.Protocol):
    """Keep-alive HTTP/1.1 for bodiless GETs, answered from prebuilt responses."""

    def __init__(self, fleet: FakeFleet, index: int) -> None:
        self.fleet = fleet
        self.index = index
        self.buffer = b""
        self.variant = random.randrange(PAGE_VARIANTS)
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            parts = head.split(b" ", 2)
            path, _, query = (parts[1] if len(parts) > 1 else b"").partition(b"?")
            if path == b"/metrics":
                self.fleet.scrapes += 1
                self.fleet.last_scrape[self.index] = time.monotonic()
                if self.fleet.changing:
                    self.variant = (self.variant + 1) % PAGE_VARIANTS
                self.transport.write(self.fleet.metrics_response(query, self.variant))
            elif path == b"/v1/models":
                self.transport.write(self.fleet.models_response)
            elif path == b"/health":
                self.transport.write(_response(b"", b"text/plain"))
            else:
                self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")


_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


class FakeFleet:
    def __init__(
        self,
        n: int,
        *,
        push: bool = False,
        changing: bool = False,
        host: str = "127.0.0.1",
        heartbeat: float = 0.5,
        tick: float = 0.01,
        changes_per_s: float = 0.0,
    ) -> None:
        self.n = n
        self.push = push
        self.changing = changing
        self.host = host
        self.heartbeat = heartbeat
        self.tick = tick
        self.changes_per_s = changes_per_s
        self._engines = metrics_engines(PAGE_VARIANTS)
        self.metric_responses = [_response(m.render(), _TEXT) for m in self._engines]
        #: Per query string: the pages of the samples its ``name[]`` asks for, rendered
        #: by the engine's own code, as a real engine's ``/metrics`` answers it.
        self._filtered: dict[bytes, list[bytes]] = {}
        models = b'{"object":"list","data":[{"id":"model","object":"model","owned_by":"fake"}]}'
        self.models_response = _response(models, b"application/json")
        self.http_ports: list[int] = []
        self.push_ports: list[int] = []
        self.scrapes = 0
        self.reports = 0
        #: When each engine was last scraped, and sampled ages of those scrapes: what a
        #: decision at a random moment would see, measured from outside the EPP.
        self.last_scrape: list[float] = []
        self.ages: list[float] = []
        self._sampler: asyncio.Task[None] | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._sockets: list[Any] = []
        self._zmq: Any = None
        self._task: asyncio.Task[None] | None = None

    def metrics_response(self, query: bytes, variant: int) -> bytes:
        """The response to ``GET /metrics?query`` for page ``variant`` (no query: all)."""
        if not query:
            return self.metric_responses[variant]
        pages = self._filtered.get(query)
        if pages is None:
            names = parse_qs(query.decode("latin-1")).get("name[]", [])
            pages = [_response(m.render(names), _TEXT) for m in self._engines]
            if len(self._filtered) < 64:  # bounded: the EPP sends one query per dialect
                self._filtered[query] = pages
        return pages[variant]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.last_scrape = [0.0] * self.n
        for i in range(self.n):
            server = await loop.create_server(self._protocol(i), self.host, 0)
            self._servers.append(server)
            self.http_ports.append(server.sockets[0].getsockname()[1])
        if self.push:
            import zmq

            self._zmq = zmq.Context()
            for _ in range(self.n):
                sock = self._zmq.socket(zmq.PUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(f"tcp://{self.host}:*")
                self._sockets.append(sock)
                self.push_ports.append(
                    int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
                )
            self._task = loop.create_task(self._publish())
        self._sampler = loop.create_task(self._sample_ages())

    async def _sample_ages(self, every: float = 0.02, per_sample: int = 32) -> None:
        rng = random.Random(1)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for i in rng.sample(range(self.n), min(per_sample, self.n)):
                if self.last_scrape[i] > 0.0 and len(self.ages) < 1_000_000:
                    self.ages.append(now - self.last_scrape[i])

    def reset_stats(self) -> None:
        self.ages.clear()
        self.scrapes = self.reports = 0
        self._stats_since = time.monotonic()

    def stats(self) -> dict[str, float]:
        """Scrapes and reports per second since the last reset; scrape-age percentiles."""
        wall = max(1e-9, time.monotonic() - getattr(self, "_stats_since", 0.0))
        ages = sorted(self.ages)

        def pct(q: float) -> float:
            return ages[min(len(ages) - 1, int(len(ages) * q))] if ages else float("nan")

        return {
            "scrapes_per_s": self.scrapes / wall,
            "reports_per_s": self.reports / wall,
            "scrape_age_p50": pct(0.5),
            "scrape_age_p99": pct(0.99),
        }

    def _protocol(self, index: int) -> Any:
        return lambda: _Http(self, index)

    def endpoints(self) -> list[dict[str, Any]]:
        out = []
        for i, port in enumerate(self.http_ports):
            entry: dict[str, Any] = {"address": self.host, "port": port}
            if self.push:
                entry["labels"] = {PUSH_LABEL: str(self.push_ports[i])}
            out.append(entry)
        return out

    def write_endpoints_file(self, path: Path, count: int | None = None) -> None:
        """Write the EPP's ``--endpoints`` file (the first ``count`` engines), atomically."""
        entries = self.endpoints()[: self.n if count is None else count]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump({"endpoints": entries}, sort_keys=False))
        tmp.replace(path)

    def _report(self, i: int, rng: random.Random, busy: bool) -> bytes:
        waiting, running = (rng.randrange(4), rng.randrange(16)) if busy else (0, 0)
        report = load.LoadReport(
            time.time(), self.tick, self.heartbeat, waiting, running,
            rng.random() * 0.5 if busy else 0.0, 16, 4096, 0, [], [],
            0.0, 0.0, 0.0, 0.0, 0.0,
        )  # fmt: skip
        return load.encode(report)

    async def _publish(self) -> None:
        """Heartbeats at a random phase per engine, and random changes across the fleet."""
        rng = random.Random(0)
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = [(now + rng.uniform(0, self.heartbeat), i) for i in range(self.n)]
        heapq.heapify(due)
        seqs = [itertools.count() for _ in range(self.n)]
        next_change = now
        while True:
            now = loop.time()
            while due and due[0][0] <= now:
                _, i = heapq.heappop(due)
                self._send(i, next(seqs[i]), self._report(i, rng, False))
                heapq.heappush(due, (now + self.heartbeat, i))
            if self.changes_per_s > 0:
                while next_change <= now:
                    i = rng.randrange(self.n)
                    self._send(i, next(seqs[i]), self._report(i, rng, True))
                    next_change += rng.expovariate(self.changes_per_s)
            wake = due[0][0] if due else now + 1.0
            if self.changes_per_s > 0:
                wake = min(wake, next_change)
            await asyncio.sleep(max(0.001, wake - loop.time()))

    def _send(self, i: int, seq: int, payload: bytes) -> None:
        import zmq

        try:
            self._sockets[i].send_multipart(
                (load.TOPIC, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
            )
            self.reports += 1
        except zmq.Again:
            pass

    async def stop(self) -> None:
        for task in (self._task, self._sampler):
            if task is not None:
                task.cancel()
        for server in self._servers:
            server.close()
        for sock in self._sockets:
            sock.close(0)
        if self._zmq is not None:
            self._zmq.term()


async def _main(args: argparse.Namespace) -> None:
    fleet = FakeFleet(
        args.endpoints,
        push=args.push,
        changing=args.changing,
        heartbeat=args.heartbeat,
        changes_per_s=args.changes_per_s,
    )
    await fleet.start()
    fleet.write_endpoints_file(Path(args.file))
    if args.stats:  # SIGUSR1: reset the counters; SIGUSR2: write them to --stats as JSON
        import json
        import signal

        loop = asyncio.get_running_loop()
        stats_path = Path(args.stats)
        loop.add_signal_handler(signal.SIGUSR1, fleet.reset_stats)
        loop.add_signal_handler(
            signal.SIGUSR2, lambda: stats_path.write_text(json.dumps(fleet.stats()))
        )
    print(f"ready: {fleet.n} endpoints in {args.file}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a fake engine fleet on loopback.")
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--file", required=True, help="the EPP endpoints file to write")
    parser.add_argument("--push", action="store_true", help="engines push load reports")
    parser.add_argument("--changing", action="store_true", help="every scrape sees a new page")
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--changes-per-s", type=float, default=0.0)
    parser.add_argument("--stats", help="file for the counters (on SIGUSR2)")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
