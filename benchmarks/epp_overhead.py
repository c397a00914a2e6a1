"""EPP overhead: latency through Envoy + EPP minus Envoy straight to the same upstream.

Both paths are real Envoys with the same generated listener (infergate.envoy.bootstrap);
the gateway one adds ext_proc (FULL_DUPLEX_STREAMED request and response bodies) to a real
``infergate epp`` over a 4-endpoint pool. Short non-streaming completions arrive open-loop
(Poisson) at each rate; the two paths run one after the other, in alternating order,
``--rounds`` times, and the overhead is the difference of their percentiles (median over
rounds, so one round disturbed by other load on the machine does not decide the figure).
The upstream answers from Envoy's ``direct_response`` (fixed, tiny latency) unless
``--upstream engine``.

Targets: <= 2 ms added at p50 and <= 10 ms at p99 at 500 requests/s.

    .venv/bin/python benchmarks/epp_overhead.py [--rates 100,500] [--seconds 6] [--upstream static|engine]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
from pathlib import Path

from infergate.bench.gateway_rig import body_of_size, open_loop, process_cpu_seconds, start_rig
from infergate.procs import ProcessGroup
from infergate.stack.probes import metric_sum

TARGET_P50_MS, TARGET_P99_MS = 2.0, 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100,500", help="requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="per path, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--upstream", default="static", choices=["static", "engine"])
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument(
        "--prompt-bytes", type=int, default=0, help="prompt size (2048, 225280); 0: 7 bytes"
    )
    parser.add_argument(
        "--accounting",
        default=None,
        choices=["engine", "observer", "body", "none"],
        help="build_envoy_config's response_accounting (overrides the two flags below)",
    )
    parser.add_argument(
        "--no-response-body",
        action="store_true",
        help="Envoy sends the EPP no response bodies (response_body_mode NONE)",
    )
    parser.add_argument(
        "--single-filter",
        action="store_true",
        help="GIE's single ext_proc filter (response chunks through the EPP) instead of the "
        "routing filter + observability-mode observer",
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(shared), Python {platform.python_version()}; upstream={args.upstream}, "
        f"{args.endpoints} endpoints, response bodies to EPP: {not args.no_response_body}, "
        f"design: {args.accounting or ('single filter' if args.single_filter else 'observer')}, "
        f"prompt {args.prompt_bytes} bytes"
    )
    with ProcessGroup() as group, tempfile.TemporaryDirectory() as tmp:
        rig = start_rig(
            group,
            Path(tmp),
            upstream=args.upstream,
            endpoints=args.endpoints,
            response_bodies=not args.no_response_body,
            observe_responses=not args.single_filter,
            response_accounting=args.accounting,
        )
        body = body_of_size(args.prompt_bytes)
        header = (
            f"{'rate':>6} {'path':>8} {'ok/sent':>11} {'p50 ms':>8} {'p90 ms':>8} "
            f"{'p99 ms':>8} {'lag99':>7}"
        )
        print(header)
        summary = []
        for rate in rates:
            runs: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
            cpu_before = process_cpu_seconds(rig.epp_pid)
            gateway_requests = 0
            for round_index in range(args.rounds):
                order = ["direct", "gateway"] if round_index % 2 == 0 else ["gateway", "direct"]
                for path in order:
                    url = rig.direct_url if path == "direct" else rig.gateway_url
                    result = asyncio.run(open_loop(url, rate, args.seconds, seed=round_index, body=body))
                    runs[path].append(result)
                    if path == "gateway":
                        gateway_requests += int(result["ok"]) + 50
                    print(
                        f"{rate:>6.0f} {path:>8} {int(result['ok']):>5}/{int(result['sent']):<5} "
                        f"{result['p50_ms']:>8.2f} {result['p90_ms']:>8.2f} "
                        f"{result['p99_ms']:>8.2f} {result['send_lag_p99_ms']:>7.2f}"
                    )
            cpu_ms = (process_cpu_seconds(rig.epp_pid) - cpu_before) * 1000 / gateway_requests

            def median(path: str, key: str, runs: dict = runs) -> float:
                return statistics.median(r[key] for r in runs[path])

            p50 = median("gateway", "p50_ms") - median("direct", "p50_ms")
            p99 = median("gateway", "p99_ms") - median("direct", "p99_ms")
            summary.append((rate, p50, p99, cpu_ms))
        scheduling = metric_sum(
            rig.epp_metrics_url, "infergate_epp_scheduling_duration_seconds_sum"
        ) / max(
            1.0, metric_sum(rig.epp_metrics_url, "infergate_epp_scheduling_duration_seconds_count")
        )

    print("\nEPP overhead (gateway minus direct, median of rounds):")
    print(f"{'rate':>6} {'p50 +ms':>9} {'p99 +ms':>9} {'EPP CPU ms/req':>15}  verdict")
    for rate, p50, p99, cpu_ms in summary:
        verdict = []
        if rate >= 500:
            verdict.append(
                "p50 ok" if p50 <= TARGET_P50_MS else f"p50 misses by {p50 - TARGET_P50_MS:.2f} ms"
            )
            verdict.append(
                "p99 ok" if p99 <= TARGET_P99_MS else f"p99 misses by {p99 - TARGET_P99_MS:.2f} ms"
            )
        print(f"{rate:>6.0f} {p50:>9.2f} {p99:>9.2f} {cpu_ms:>15.2f}  {', '.join(verdict)}")
    print(f"EPP scheduling decision (its own histogram): mean {scheduling * 1000:.3f} ms")


if __name__ == "__main__":
    main()
