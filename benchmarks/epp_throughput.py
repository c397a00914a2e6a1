"""The most requests/s one EPP process sustains behind a real Envoy.

Closed loop: C clients send short non-streaming completions back to back through the
gateway Envoy (ext_proc to one ``infergate epp``, 4-endpoint pool, fixed-latency upstream)
for a few seconds at each concurrency. The same clients against the direct twin (no
ext_proc) give the rig's own ceiling, so a low gateway figure can be told apart from a
slow load generator. The EPP's CPU per request comes from /proc.

    .venv/bin/python benchmarks/epp_throughput.py [--concurrency 8,32,128] [--seconds 5]
        [--epp-replicas N]   # N replicas behind Envoy's ext_proc cluster
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
from pathlib import Path

from gateway_rig import body_of_size, closed_loop, process_cpu_seconds, start_rig

from infergate.procs import ProcessGroup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="8,32,128")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--upstream", default="static", choices=["static", "engine"])
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument(
        "--no-response-body",
        action="store_true",
        help="Envoy sends the EPP no response bodies (response_body_mode NONE)",
    )
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--prompt-bytes", type=int, default=0, help="2048, 225280; 0: 7 bytes")
    parser.add_argument("--workers", type=int, default=1, help="infergate epp --workers")
    parser.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        help="EPP replicas behind Envoy's ext_proc cluster (one endpoint each); CPU per "
        "request sums them",
    )
    parser.add_argument(
        "--streams-per-connection",
        type=int,
        default=100000,
        help="Envoy's ext-proc streams per HTTP/2 connection to the EPP (low: more connections, "
        "spread over --workers)",
    )
    parser.add_argument(
        "--accounting", default="engine", choices=["engine", "observer", "body", "none"]
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(shared), Python {platform.python_version()}; upstream={args.upstream}, "
        f"{args.endpoints} endpoints, Envoy --concurrency {args.envoy_concurrency}, "
        f"response accounting {args.accounting}, prompt {args.prompt_bytes} B, "
        f"EPP workers {args.workers}, {args.streams_per_connection} streams/connection, "
        f"{args.epp_replicas} EPP replica(s)"
    )
    best = 0.0
    with ProcessGroup() as group, tempfile.TemporaryDirectory() as tmp:
        rig = start_rig(
            group,
            Path(tmp),
            upstream=args.upstream,
            endpoints=args.endpoints,
            envoy_concurrency=args.envoy_concurrency,
            response_bodies=not args.no_response_body,
            response_accounting="none" if args.no_response_body else args.accounting,
            epp_args=["--workers", str(args.workers)] if args.workers > 1 else [],
            bootstrap={"epp_streams_per_connection": args.streams_per_connection},
            epp_replicas=args.epp_replicas,
        )
        body = body_of_size(args.prompt_bytes)
        print(
            f"{'clients':>7} {'path':>8} {'req/s':>9} {'fail':>5} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'EPP CPU ms/req':>15}"
        )
        for clients in levels:
            for path, url in (("direct", rig.direct_url), ("gateway", rig.gateway_url)):
                cpu_before = sum(process_cpu_seconds(pid) for pid in rig.epp_pids)
                result = asyncio.run(closed_loop(url, clients, args.seconds, body))
                cpu = sum(process_cpu_seconds(pid) for pid in rig.epp_pids) - cpu_before
                served = result["rps"] * args.seconds
                per_request = f"{cpu * 1000 / served:.2f}" if path == "gateway" and served else "-"
                if path == "gateway":
                    best = max(best, result["rps"])
                print(
                    f"{clients:>7} {path:>8} {result['rps']:>9.0f} {int(result['failures']):>5} "
                    f"{result['p50_ms']:>8.2f} {result['p99_ms']:>8.2f} {per_request:>15}"
                )
    print(
        f"\nmost requests/s through the EPP ({args.workers} worker(s), "
        f"{args.epp_replicas} replica(s)): {best:.0f}"
    )


if __name__ == "__main__":
    main()
