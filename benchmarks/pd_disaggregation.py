"""Prefill/decode disaggregation on a simulated fleet: decode ITL and TTFT with and without P/D.

Two fleets of the same size (3 simulated engines, H100/Llama-3-8B timing, behind the real
Envoy and the EPP), the same seeded long-prompt mix (Poisson arrivals; ``--long-share`` of
the prompts are ``--long`` tokens, the others ``--short``; every request streams
``--output`` tokens):

- **aggregated**: 3 engines that prefill and decode, the EPP with GIE's default profile;
- **P/D**: 1 prefill engine + 2 decode engines, the EPP with ``builtin:pd`` (threshold
  256 uncached tokens), KV pulled over the engines' ZMQ connector; a transfer is priced at
  ``--link-gbps`` (``--kv-transfer-bandwidth-gbps``) for the modelled 128 KiB per token.

In the aggregated fleet a long prefill shares the step with every running decode (the
step lasts as long as the prefill chunk), so decodes stutter; with P/D the decode engines
only compute the last partial block of a long prompt. ITL percentiles are over every gap
between streamed tokens of every request; TTFT is what the client sees (P/D adds the
prefill hop and the modelled transfer). ``sim lag`` is the engines' late time over their
modelled time: above ~10 % the machine could not keep the simulation faithful.

``--time-scale K`` runs the modelled GPU K times slower (every timing constant and the
link × K, the arrival rate ÷ K) and divides the measured latencies by K, so a small
machine keeps the simulation faithful at the cost of shrinking the host's own overheads
(HTTP, Envoy, EPP, the connector) K-fold in the figures.

    .venv/bin/python benchmarks/pd_disaggregation.py [--rate 3] [--num-prompts 120]
        [--time-scale 1] [--link-gbps 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from infergate.bench.datasets import SampleRequest, Tokens
from infergate.bench.runner import BenchConfig, run_benchmark
from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model

SIM_COUNTERS = ("infergate_sim_late_seconds_total", "infergate_sim_modelled_seconds_total")


def workload(args: argparse.Namespace, tokens: Tokens) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    samples = []
    for i in range(args.num_prompts):
        length = args.long if rng.random() < args.long_share else args.short
        prompt = f"{i}: " + tokens.text(length, rng)
        samples.append(SampleRequest(prompt, args.output, tokens.count(prompt)))
    return samples


def sim_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = dict.fromkeys(SIM_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def run(
    name: str, spec: StackSpec, samples: list[SampleRequest], args: argparse.Namespace
) -> dict[str, Any]:
    with LocalStack(spec) as stack:
        before = [sim_counters(u) for u in stack.engine_urls]
        report = asyncio.run(
            run_benchmark(
                BenchConfig(
                    base_url=stack.base_url,
                    samples=samples,
                    model=stack.model_name,
                    request_rate=args.rate / args.time_scale,
                    ignore_eos=True,
                    progress=False,
                    seed=args.seed,
                )
            )
        )
        after = [sim_counters(u) for u in stack.engine_urls]
    late = sum(a[SIM_COUNTERS[0]] - b[SIM_COUNTERS[0]] for a, b in zip(after, before, strict=True))
    modelled = sum(
        a[SIM_COUNTERS[1]] - b[SIM_COUNTERS[1]] for a, b in zip(after, before, strict=True)
    )
    row = {
        "fleet": name,
        "completed": report["completed"],
        "failed": report.get("failed", 0),
        "ttft_p50_ms": report["median_ttft_ms"] / args.time_scale,
        "ttft_p99_ms": report["p99_ttft_ms"] / args.time_scale,
        "itl_p50_ms": report["median_itl_ms"] / args.time_scale,
        "itl_p99_ms": report["p99_itl_ms"] / args.time_scale,
        "output_tok_s": report["output_throughput"] * args.time_scale,
        "sim_lag": late / modelled if modelled else 0.0,
    }
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--short", type=int, default=150)
    parser.add_argument("--long-share", type=float, default=0.4)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--link-gbps", type=float, default=100.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args()

    model = ensure_tiny_model()
    samples = workload(args, Tokens(model))
    k = args.time_scale
    timing = ["--sim-base-ms", str(6.0 * k), "--sim-us-per-token", str(30.0 * k),
              "--sim-us-per-kv-token", str(0.05 * k), "--sim-us-per-seq", str(15.0 * k),
              "--sim-ns-per-attention-pair", str(1.0 * k)]  # fmt: skip
    common: dict[str, Any] = {"model": model, "served_model_name": "tiny", "simulate": True,
                              "access_log": False}  # fmt: skip
    aggregated = StackSpec.on_free_ports(
        engines=3, epp_config_file=Path("builtin:gie-default"), engine_args=timing, **common
    )
    pd = StackSpec.on_free_ports(
        engines=3,
        roles=["prefill", "decode", "decode"],
        pd_threshold=256,
        engine_args=[*timing, "--kv-transfer-bandwidth-gbps", str(args.link_gbps / k)],
        **common,
    )
    rows = [run("aggregated (3 both)", aggregated, samples, args),
            run("P/D (1 prefill + 2 decode)", pd, samples, args)]  # fmt: skip
    print()
    print(
        "| fleet | completed | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s | sim lag |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fleet']} | {r['completed']}/{r['completed'] + r['failed']} "
              f"| {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms "
              f"| {r['itl_p50_ms']:.1f} ms | {r['itl_p99_ms']:.1f} ms "
              f"| {r['output_tok_s']:.0f} | {r['sim_lag']:.1%} |")  # fmt: skip
    if args.result_file is not None:
        args.result_file.write_text(json.dumps({"args": vars(args) | {"result_file": None},
                                                "rows": rows}, indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
