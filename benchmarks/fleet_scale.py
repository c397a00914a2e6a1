"""EPP cost and freshness against fleet size, on a fake fleet (issue 21).

For each case a fake fleet (:mod:`tests.support.fake_fleet`: one process, N loopback
engines with a real ~30 KB vLLM-names metrics page, optionally pushing load reports) and
a real ``infergate epp`` process (``--endpoints FILE``, default 50 ms interval) run side
by side. Measured, per case:

* idle: the EPP process's CPU (cores, utime+stime from /proc) over ``--seconds``, no
  requests;
* load: the same while this process drives ext-proc streams at ``--rate`` per second
  (request headers + body + response headers + body, as Envoy sends them; no engine);
* metrics age: for scraped fleets, sampled by the fleet (time since each engine's last
  scrape, at random moments: what a decision would see); for pushing fleets, the EPP's
  own ``infergate_epp_pick_metrics_age_seconds`` histogram over the load phase (bucket
  upper bounds, so "<=").

Cases: ``push:N`` (engines push), ``scrape:N`` (idle engines, unchanged pages),
``scrape-changing:N`` (every scrape sees a new page: the scraper's costly case).
``--baseline PYTHON`` runs every case a second time with another checkout's EPP
(e.g. the code before this change) in the same run, for ratios.

    .venv/bin/python benchmarks/fleet_scale.py
    .venv/bin/python benchmarks/fleet_scale.py --cases push:1000,scrape:500 \\
        --baseline /work/wt/fleet-base/.venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from infergate.epp.options import EPP_PORTS, EppOptions

from infergate.procs import ProcessGroup, free_port, tcp_ready

sys.path.insert(0, str(Path(__file__).parent))
from epp_decision import _cpu_seconds, run_stream

#: The fake fleet (tests/support/fake_fleet.py), run as a script in its own process.
FAKE_FLEET = Path(__file__).resolve().parents[1] / "tests" / "support" / "fake_fleet.py"


def _age_histogram(metrics_port: int) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the pick-age histogram, per source ({} if absent)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "infergate_epp_pick_metrics_age_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                source = sample.labels["source"]
                out.setdefault(source, {})[float(sample.labels["le"])] = sample.value
    return out


def _quantiles(before: dict[float, float], after: dict[float, float]) -> str:
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return "n/a"

    def q(p: float) -> str:
        for le, c in counts:
            if c >= p * total:
                return f"<={le * 1e3:g}ms"
        return "inf"

    return f"p50 {q(0.5)} p99 {q(0.99)} (n={total:.0f})"


async def _drive(port: int, rate: float, seconds: float) -> list[float]:
    """Ext-proc streams at ``rate``/s (open loop) for ``seconds``; their latencies."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(i: int) -> None:
            started = time.perf_counter()
            await run_stream(stub, i)
            latencies.append(time.perf_counter() - started)

        tasks = []
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks, return_exceptions=True)
    return sorted(latencies)


def _fleet_stats(fleet_pid: int, path: Path) -> dict[str, float]:
    path.unlink(missing_ok=True)
    os.kill(fleet_pid, signal.SIGUSR2)
    for _ in range(100):
        if path.exists() and path.stat().st_size:
            return dict(json.loads(path.read_text()))
        time.sleep(0.05)
    return {}


def run_case(python: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, n = case.split(":")
    flags = {"push": ["--push"], "scrape": [], "scrape-changing": ["--changing"]}[mode]
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup() as group:
        file, stats = Path(tmp) / "fleet.yaml", Path(tmp) / "stats.json"
        fleet = group.start(
            "fleet",
            [sys.executable, str(FAKE_FLEET), "--endpoints", n,
             "--file", str(file), "--stats", str(stats), *flags],
            ready=file.exists, timeout=300,
        )  # fmt: skip
        grpc_port, metrics_port = free_port(), free_port()
        options = EppOptions(
            endpoints_file=file, host="127.0.0.1", grpc_port=grpc_port,
            grpc_health_port=free_port(), metrics_port=metrics_port, log_level="error",
        )  # fmt: skip
        epp = group.start(
            "epp",
            [python, "-m", "infergate.cli", *options.argv(always=EPP_PORTS)],
            ready=tcp_ready("127.0.0.1", grpc_port), timeout=300,
        )  # fmt: skip
        time.sleep(args.warmup + int(n) / 200)
        os.kill(fleet.pid, signal.SIGUSR1)
        cpu0, wall0 = _cpu_seconds(epp.pid), time.monotonic()
        time.sleep(args.seconds)
        idle = (_cpu_seconds(epp.pid) - cpu0) / (time.monotonic() - wall0)
        idle_stats = _fleet_stats(fleet.pid, stats)
        hist0 = _age_histogram(metrics_port)
        os.kill(fleet.pid, signal.SIGUSR1)
        cpu0, wall0 = _cpu_seconds(epp.pid), time.monotonic()
        latencies = asyncio.run(_drive(grpc_port, args.rate, args.seconds))
        loaded = (_cpu_seconds(epp.pid) - cpu0) / (time.monotonic() - wall0)
        load_stats = _fleet_stats(fleet.pid, stats)
        hist1 = _age_histogram(metrics_port)
    ages = {src: _quantiles(hist0.get(src, {}), h) for src, h in hist1.items()}
    return {
        "idle": idle,
        "loaded": loaded,
        "idle_stats": idle_stats,
        "load_stats": load_stats,
        "ages": ages,
        "streams": len(latencies),
        "stream_p50": latencies[len(latencies) // 2] * 1e3 if latencies else float("nan"),
        "stream_p99": latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else float("nan"),
    }


def _line(label: str, case: str, r: dict[str, Any]) -> str:
    s, ls = r["idle_stats"], r["load_stats"]
    scraped = (
        f"scrapes/s idle {s.get('scrapes_per_s', 0):.0f} load {ls.get('scrapes_per_s', 0):.0f}; "
        f"scrape age idle p50 {s.get('scrape_age_p50', float('nan')) * 1e3:.0f} "
        f"p99 {s.get('scrape_age_p99', float('nan')) * 1e3:.0f} ms, load p50 "
        f"{ls.get('scrape_age_p50', float('nan')) * 1e3:.0f} "
        f"p99 {ls.get('scrape_age_p99', float('nan')) * 1e3:.0f} ms"
    )
    ages = "; ".join(f"pick age[{k}] {v}" for k, v in r["ages"].items()) or "pick age n/a"
    return (
        f"{label:>8} {case:<20} idle {r['idle']:.3f} cores, load {r['loaded']:.3f} cores "
        f"({r['streams']} streams, p50 {r['stream_p50']:.1f} ms p99 {r['stream_p99']:.1f} ms); "
        f"{scraped}; {ages}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        default="push:100,push:500,push:1000,scrape:100,scrape:500,"
        "scrape-changing:100,scrape-changing:500",
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=200.0, help="ext-proc streams per second")
    parser.add_argument("--baseline", help="python of another checkout to run the same cases")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}, cpus {os.cpu_count()}", flush=True)
    for case in args.cases.split(","):
        runs = [("this", sys.executable)]
        if args.baseline:
            runs.append(("baseline", args.baseline))
        for label, python in runs:
            print(_line(label, case, run_case(python, case, args)), flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
