"""Route changes through a Gateway's Envoy: how fast traffic follows, and what it costs.

(a) Latency: the route flips between backends A and B ``--changes`` times; for each flip,
    the time from issuing the change to the first request answered by the new backend
    (a client polls ``GET /who`` back to back), p50/p99. For the local rig, also the
    time until the ADS server saw every replica ACK the change.
(b) Loss: ``--rate`` streaming (SSE) requests per second, open loop, while the route
    flips ``--load-changes`` times; a request is lost when it is not a 200 or its stream
    is not complete (every event, in order, from one backend, then ``[DONE]``).

The change is pluggable (:class:`Rig`): the local rig (default) runs the ADS server on
its own event loop thread, one real Envoy and two SSE backends, and changes the route with
``AdsServer.set_snapshot``. With ``--through-operator``, :class:`OperatorRig` brings up
the conformance suite's control-plane driver (etcd, kube-apiserver, controllers, kwok;
the chart installed with helm; the operator as a process; pods run by the conformance
pod runtime) with ``gateway_route_change.yaml``: a Gateway of class infergate, whose
Envoy runs on the operator's bootstrap and gets its config from the operator over xDS,
and two SSE backends behind Services. A change is a ``kubectl apply`` of the HTTPRoute
naming the other Service; the time counted starts before kubectl does.

    python benchmarks/gateway_route_change.py [--changes 50] [--load-changes 20] [--rate 100]
    python benchmarks/gateway_route_change.py --through-operator
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import httpx
import yaml

from infergate.gateway.xds import AdsServer

# The test harness (tests/support/) is a folder of this checkout, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infergate.procs import ProcessGroup, free_port
from tests.support.xds_harness import (
    BackgroundLoop,
    SseBackend,
    check_sse,
    route_snapshot,
    start_gateway_envoy,
)

if TYPE_CHECKING:
    from conformance.drivers.controlplane import ControlPlaneDriver

NODE = "bench/gateway"


class Rig(Protocol):
    """A Gateway whose route can be switched between two backends."""

    backends: tuple[str, str]

    @property
    def base_url(self) -> str:
        """Where the Gateway listens (``http://host:port``)."""
        ...

    async def change(self, to: str) -> None:
        """Issue a change routing everything to backend ``to``; return once issued."""
        ...

    async def applied(self) -> float | None:
        """Seconds from the last change until the proxies acked it, when known."""
        ...

    def backend_of(self, body: bytes) -> str | None:
        """The backend that answered ``GET /who`` with ``body``."""
        ...

    def stream_backend(self, body: bytes) -> str | None:
        """The backend of a complete stream, None when it is truncated or mixed."""
        ...


@dataclass
class LocalRig:
    """ADS server + one Envoy (concurrency 1) + two SSE backends, all on this machine."""

    events: int
    keep_clusters: bool = False
    """Keep both backends' clusters in every snapshot; by default a snapshot has only the
    routed backend's cluster, as a translator emits, so each flip also adds one cluster
    and removes another (the make-before-break path)."""
    backends: tuple[str, str] = ("a", "b")
    group: ProcessGroup = field(default_factory=ProcessGroup)
    loop: BackgroundLoop = field(default_factory=BackgroundLoop)
    server: AdsServer = field(default_factory=AdsServer)
    listen_port: int = field(default_factory=free_port)
    _changed_at: float = 0.0
    _servers: dict[str, SseBackend] = field(default_factory=dict)

    def start(self, workdir: Path) -> LocalRig:
        xds_port = self.loop.run(self.server.start("127.0.0.1:0"))
        self._servers = {name: SseBackend(name) for name in self.backends}
        self.server.set_snapshot(NODE, self._snapshot(self.backends[0]))
        start_gateway_envoy(
            self.group, workdir, name="envoy", node_id=NODE, xds_port=xds_port,
            admin_port=free_port(),
        )  # fmt: skip
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def _snapshot(self, to: str) -> Any:
        servers = self._servers if self.keep_clusters else {to: self._servers[to]}
        return route_snapshot(self.listen_port, servers, to)

    async def change(self, to: str) -> None:
        self._changed_at = time.perf_counter()
        # From this (the client's) thread, as an operator handler thread would.
        self.server.set_snapshot(NODE, self._snapshot(to))

    async def applied(self) -> float | None:
        waiter = asyncio.run_coroutine_threadsafe(
            self.server.wait_acked(NODE, timeout=30), self.loop.loop
        )
        ok = await asyncio.wrap_future(waiter)
        return time.perf_counter() - self._changed_at if ok else None

    def backend_of(self, body: bytes) -> str | None:
        return backend_named(body)

    def stream_backend(self, body: bytes) -> str | None:
        return check_sse(body, self.events)

    def close(self) -> None:
        self.group.stop_all()
        for backend in self._servers.values():
            backend.close()
        self.loop.run(self.server.stop(0))
        self.loop.close()


def backend_named(body: bytes) -> str | None:
    """The ``backend`` an SSE backend's ``GET /who`` answer names (None: not such an answer)."""
    try:
        return str(json.loads(body)["backend"])
    except (ValueError, KeyError, TypeError):
        return None


MANIFEST = Path(__file__).with_name("gateway_route_change.yaml")
BENCH_NS = "gateway-bench"
BENCH_GATEWAY = "bench"


@dataclass
class OperatorRig:
    """The same two-backend flip through the real operator: what a user sees between
    ``kubectl apply`` of an HTTPRoute and traffic following it (API server, operator
    watch, translation, ADS push, Envoy's RDS/CDS update), not only the xDS leg."""

    events: int
    backends: tuple[str, str] = ("a", "b")
    kubectl_s: list[float] = field(default_factory=list)
    """Seconds each change's ``kubectl apply`` took, in order: how much of the time to
    follow is the client itself."""
    _driver: ControlPlaneDriver | None = None
    _address: str = ""

    def start(self, workdir: Path) -> OperatorRig:
        """Control plane, chart, operator and the topology; returns once the Gateway
        answers from each backend in turn (so no flip pays for a backend starting)."""
        driver_class, bin_dir = _controlplane_driver()
        objects = [o for o in self._manifest(self.backends[0]) if o["kind"] != "HTTPRoute"]
        self._driver = driver_class(
            workdir, [_infergate_cli()], bin_dir, "infergate",
            objects=objects, namespaces=(BENCH_NS,),
        )  # fmt: skip
        for to in self.backends[::-1]:  # B, then A: measuring starts on A
            self._kubectl_apply(to)
            if not self._address:
                self._address = self.driver.gateway_address(BENCH_GATEWAY, BENCH_NS)
            self._settle(to)
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self._address}"

    def _manifest(self, to: str) -> list[dict[str, Any]]:
        text = MANIFEST.read_text().replace("{BACKEND}", to)
        return [doc for doc in yaml.safe_load_all(text) if doc]

    @property
    def driver(self) -> ControlPlaneDriver:
        assert self._driver is not None, "OperatorRig.start() first"
        return self._driver

    def _kubectl_apply(self, to: str) -> None:
        """``kubectl apply`` of the HTTPRoute to backend ``to``, as a user would."""
        route = [o for o in self._manifest(to) if o["kind"] == "HTTPRoute"]
        self.driver.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(route))

    def _settle(self, to: str, timeout: float = 180.0) -> None:
        """Wait, through connection errors and 404/503s, until ``to`` answers."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                try:
                    response = client.get(f"{self.base_url}/who")
                    if response.status_code == 200 and self.backend_of(response.content) == to:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"the Gateway never answered from {to} within {timeout}s")

    async def change(self, to: str) -> None:
        # kubectl is a blocking subprocess: on a thread, so load (b) keeps its rate.
        start = time.perf_counter()
        await asyncio.to_thread(self._kubectl_apply, to)
        self.kubectl_s.append(time.perf_counter() - start)

    async def applied(self) -> float | None:
        return None  # the ADS server is in the operator's process: acks are not seen here

    def backend_of(self, body: bytes) -> str | None:
        return backend_named(body)

    def stream_backend(self, body: bytes) -> str | None:
        return check_sse(body, self.events)

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()


def _controlplane_driver() -> tuple[type[ControlPlaneDriver], Path]:
    """The conformance suite's control-plane driver class and the binaries it needs.
    ``conformance`` is a folder of this checkout (the repo root is on the path)."""
    from conformance.drivers.controlplane import ControlPlaneDriver
    from tests.support.controlplane import binaries_dir, missing_binaries

    bin_dir = binaries_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        raise SystemExit(f"control-plane binaries missing in {bin_dir}: {missing}")
    return ControlPlaneDriver, bin_dir


def _infergate_cli() -> str:
    """This environment's ``infergate`` (the operator and pods run it)."""
    import shutil

    return shutil.which("infergate") or str(Path(sys.executable).parent / "infergate")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def first_answer_from(
    rig: Rig, session: aiohttp.ClientSession, to: str, deadline_s: float = 30.0
) -> float:
    """Seconds until a request is answered by ``to`` (polled back to back)."""
    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        async with session.get(f"{rig.base_url}/who") as response:
            body = await response.read()
        if response.status == 200 and rig.backend_of(body) == to:
            return time.perf_counter() - start
    raise TimeoutError(f"traffic never reached {to} within {deadline_s}s")


async def measure_latency(rig: Rig, changes: int) -> dict[str, Any]:
    """(a): per flip, issue-to-first-answer from the new backend (and to all-acked)."""
    follow: list[float] = []
    acked: list[float] = []
    async with aiohttp.ClientSession() as session:
        current = rig.backends[0]
        await first_answer_from(rig, session, current)
        for index in range(changes):
            to = rig.backends[(index + 1) % 2]
            issued = time.perf_counter()
            await rig.change(to)
            waiter = asyncio.ensure_future(rig.applied())
            await first_answer_from(rig, session, to)
            follow.append(time.perf_counter() - issued)
            applied = await waiter
            if applied is not None:
                acked.append(applied)
    return {"changes": changes, "follow_s": summary(follow), "acked_s": summary(acked)}


async def measure_loss(
    rig: Rig, *, changes: int, rate: float, events: int, interval_ms: int, spacing_s: float
) -> dict[str, Any]:
    """(b): open-loop streaming at ``rate``/s while the route flips ``changes`` times."""
    outcomes: Counter[str] = Counter()
    served: Counter[str] = Counter()
    url = f"{rig.base_url}/sse?events={events}&interval_ms={interval_ms}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            try:
                async with session.get(url) as response:
                    body = await response.read()
                if response.status != 200:
                    outcomes[f"status {response.status}"] += 1
                    return
                backend = rig.stream_backend(body)
                outcomes["ok" if backend else "truncated"] += 1
                served[backend or "-"] += 1
            except (TimeoutError, aiohttp.ClientError) as error:
                outcomes[type(error).__name__] += 1

        stop = asyncio.Event()

        async def load() -> None:
            tasks = []
            start = time.perf_counter()
            sent = 0
            while not stop.is_set():
                now = time.perf_counter() - start
                while sent < now * rate:
                    tasks.append(asyncio.ensure_future(one()))
                    sent += 1
                await asyncio.sleep(1 / rate / 2)
            await asyncio.gather(*tasks)

        async with session.get(f"{rig.base_url}/who") as response:
            first = rig.backends.index(rig.backend_of(await response.read()) or rig.backends[0])

        async def flips() -> None:
            # The load lasts until a spacing after the last flip, however long each
            # change takes to issue (a kubectl apply is not instant).
            await asyncio.sleep(spacing_s)
            for index in range(changes):
                await rig.change(rig.backends[(first + index + 1) % 2])
                await asyncio.sleep(spacing_s)
            await asyncio.sleep(spacing_s)
            stop.set()

        await asyncio.gather(load(), flips())
    total = sum(outcomes.values())
    return {
        "changes": changes,
        "rate_per_s": rate,
        "requests": total,
        "lost": total - outcomes["ok"],
        "outcomes": dict(outcomes),
        "served_by": dict(served),
    }


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50_ms": round(percentile(values, 0.5) * 1000, 2),
        "p99_ms": round(percentile(values, 0.99) * 1000, 2),
        "max_ms": round(max(values) * 1000, 2),
        "mean_ms": round(statistics.fmean(values) * 1000, 2),
    }


async def run(rig: Rig, args: argparse.Namespace) -> dict[str, Any]:
    latency = await measure_latency(rig, args.changes)
    loss = await measure_loss(
        rig,
        changes=args.load_changes,
        rate=args.rate,
        events=args.events,
        interval_ms=args.interval_ms,
        spacing_s=args.spacing_s,
    )
    return {"latency": latency, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--changes", type=int, default=50, help="route flips timed in (a)")
    parser.add_argument("--load-changes", type=int, default=20, help="route flips in (b)")
    parser.add_argument("--rate", type=float, default=100.0, help="streams per second in (b)")
    parser.add_argument("--events", type=int, default=10, help="SSE events per stream")
    parser.add_argument("--interval-ms", type=int, default=30, help="between SSE events")
    parser.add_argument("--spacing-s", type=float, default=0.5, help="between flips in (b)")
    parser.add_argument(
        "--keep-clusters",
        action="store_true",
        help="local rig: flips change only the route (default: each flip also swaps clusters)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--through-operator",
        action="store_true",
        help="flip an HTTPRoute with kubectl apply through the real operator on the real "
        "control plane (needs `make controlplane`)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gw-route-bench-") as workdir:
        rig = make_rig(args, Path(workdir))
        try:
            result = asyncio.run(run(rig, args))
        finally:
            rig.close()
    if isinstance(rig, OperatorRig):
        result["latency"]["kubectl_s"] = summary(rig.kubectl_s[: args.changes])
    result["mode"] = "through-operator" if args.through_operator else "local"
    report(result, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def make_rig(args: argparse.Namespace, workdir: Path) -> LocalRig | OperatorRig:
    """The rig ``args`` ask for, started (closed again if starting fails)."""
    rig: LocalRig | OperatorRig
    if args.through_operator:
        rig = OperatorRig(events=args.events)
    else:
        rig = LocalRig(events=args.events, keep_clusters=args.keep_clusters)
    try:
        return rig.start(workdir)
    except BaseException:
        rig.close()
        raise


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    latency, loss = result["latency"], result["loss"]
    print(f"(a) route flip -> first answer from the new backend, {latency['changes']} flips")
    print(f"    issue -> traffic follows: {latency['follow_s']}")
    if latency.get("kubectl_s"):
        print(f"    of which kubectl apply itself: {latency['kubectl_s']}")
    if latency["acked_s"]:
        print(f"    issue -> every replica acked: {latency['acked_s']}")
    print(
        f"(b) {loss['requests']} streams at {loss['rate_per_s']:.0f}/s "
        f"({args.events} events x {args.interval_ms} ms) across {loss['changes']} flips "
        f"every {args.spacing_s}s"
    )
    print(
        f"    lost: {loss['lost']}  outcomes: {loss['outcomes']}  by backend: {loss['served_by']}"
    )


if __name__ == "__main__":
    main()
