"""EPP collector CPU: 64 endpoints scraped at 20 Hz (every 50 ms) from real local servers.

A child process serves a real engine metrics page (rendered by the engine's own
``EngineMetrics`` registry, vLLM names, histograms included) on 64 loopback ports. This
process runs only the EPP's ``Collectors`` (aiohttp keep-alive, the regex line pick, values
read directly) and reports its own CPU use and the achieved scrape rate.

    .venv/bin/python benchmarks/epp_collector.py [--endpoints 64] [--interval 0.05] [--seconds 10]
    .venv/bin/python benchmarks/epp_collector.py --no-filter   # parse whole pages, for comparison
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from typing import Any

from infergate.procs import free_port


def serve(ports: list[int], ready: Any) -> None:
    from aiohttp import web
    from infergate.engine.metrics import EngineMetrics

    metrics = EngineMetrics("model", block_size=16, num_gpu_blocks=4096)
    page = metrics.render()

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


async def collect(ports: list[int], interval: float, seconds: float) -> tuple[float, float, int]:
    from infergate.epp.datalayer.collector import Collectors
    from infergate.epp.datalayer.datastore import Datastore
    from infergate.epp.types import Endpoint

    datastore = Datastore()
    datastore.set_endpoints(Endpoint("127.0.0.1", port) for port in ports)
    collectors = Collectors(datastore, interval=interval, timeout=1.0)
    await collectors.start()
    await asyncio.sleep(1.0)  # connections open, steady state
    scrapes0, cpu0, wall0 = collectors.scrapes, time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    scrapes, cpu, wall = (
        collectors.scrapes - scrapes0,
        time.process_time() - cpu0,
        time.monotonic() - wall0,
    )
    failures = collectors.failures
    await collectors.stop()
    return cpu / wall, scrapes / wall, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--no-filter", action="store_true", help="also run every page through prometheus_client"
    )
    args = parser.parse_args()
    if args.no_filter:  # the cost the line pick saves: the library parser over whole pages
        import infergate.epp.datalayer.collector as collector
        from infergate.epp.datalayer.dialects import parse_metrics
        from prometheus_client.parser import text_string_to_metric_families

        def parse_whole(text: bytes, dialect: Any) -> Any:
            for _ in text_string_to_metric_families(text.decode()):
                pass
            return parse_metrics(text, dialect)

        collector.parse_metrics = parse_whole
    ports = [free_port() for _ in range(args.endpoints)]
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(ports, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise SystemExit("metrics servers did not start")
        from infergate.engine.metrics import EngineMetrics

        page = EngineMetrics("model", block_size=16, num_gpu_blocks=4096).render()
        cpu, rate, failures = asyncio.run(collect(ports, args.interval, args.seconds))
        target = args.endpoints / args.interval
        lines = len(page.splitlines())
        print(f"page: {len(page)} bytes, {lines} lines; filter: {not args.no_filter}")
        print(f"endpoints {args.endpoints}, interval {args.interval * 1e3:.0f} ms: "
              f"scrapes/s {rate:.0f} (target {target:.0f}), collector CPU {cpu * 100:.1f}% of one core, "
              f"failures {failures}")  # fmt: skip
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
