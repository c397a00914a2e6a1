"""What prefix-aware routing buys: the same shared-prefix load through the EPP and through
a plain least-request Envoy, over the same simulated engines.

Starts a local stack (N simulated engines with a deliberately small KV cache, so each can
hold only a few groups' prefixes, the EPP, Envoy) plus a twin Envoy without ext_proc that
balances least-request over the same engines. ``infergate bench serve``'s runner then sends
the shared-prefix dataset through each, alternating, with fresh prefixes every run (so no
run inherits another's warm caches), and prints TTFT/TPOT/E2E side by side.

    python -m infergate.bench.routing_compare [--engines 4] [--rate 12] [--prompts 200]
        [--groups 8] [--prefix-len 2000] [--kv-blocks 450] [--rounds 2] [--precise-prefix]
"""

from __future__ import annotations

import argparse
import asyncio

from infergate.bench.datasets import Tokens, shared_prefix_dataset
from infergate.bench.gateway_rig import direct_twin
from infergate.bench.runner import BenchConfig, run_benchmark
from infergate.envoy.process import start_envoy
from infergate.procs import free_port
from infergate.stack.local import LocalStack, StackSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rate", type=float, default=12.0)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=450, help="KV blocks per engine")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--precise-prefix",
        action="store_true",
        help="the EPP scores prefixes from the engines' KV events (up --precise-prefix)",
    )
    args = parser.parse_args()

    spec = StackSpec.on_free_ports(
        engines=args.engines,
        access_log=False,
        engine_args=["--num-gpu-blocks-override", str(args.kv_blocks)],
        precise_prefix=args.precise_prefix,
        kv_events_ports=[free_port() for _ in range(args.engines)],
    )
    print(
        f"{args.engines} simulated engines x {args.kv_blocks} KV blocks; {args.prompts} "
        f"requests at {args.rate}/s, {args.groups} groups sharing {args.prefix_len}-token "
        f"prefixes, {args.suffix_len}-token questions, {args.output_len} output tokens"
    )
    with LocalStack(spec) as stack:
        baseline_port = free_port()
        assert stack.workdir is not None and stack.model_dir is not None
        twin = direct_twin(
            stack.envoy_config(
                listen_port=baseline_port,
                admin_port=free_port(),
                failure_mode_allow=True,
                access_log=False,
            )
        )
        start_envoy(stack.group, twin, stack.workdir / "baseline.yaml", name="baseline")
        tokens = Tokens(stack.model_dir)
        paths = [
            ("least-request", f"http://127.0.0.1:{baseline_port}"),
            ("EPP (precise)" if args.precise_prefix else "infergate EPP", stack.base_url),
        ]
        print(
            f"{'path':<14} {'ok':>4} {'TTFT mean':>10} {'p50':>7} {'p90':>7} {'p99':>7} "
            f"{'TPOT':>6} {'E2E mean':>9}  (ms)"
        )
        run = 0
        for _ in range(args.rounds):
            for name, url in paths:
                run += 1
                samples = shared_prefix_dataset(
                    args.prompts,
                    num_groups=args.groups,
                    prefix_len=args.prefix_len,
                    suffix_len=args.suffix_len,
                    output_len=args.output_len,
                    tokens=tokens,
                    seed=1000 + run,  # fresh prefixes: no run inherits warm caches
                )
                config = BenchConfig(
                    base_url=url,
                    samples=samples,
                    model=stack.model_name,
                    request_rate=args.rate,
                    ignore_eos=True,
                    progress=False,
                    seed=run,
                )
                r = asyncio.run(run_benchmark(config))
                print(
                    f"{name:<14} {r['completed']:>4} {r['mean_ttft_ms']:>10.1f} "
                    f"{r['median_ttft_ms']:>7.1f} {r['p90_ttft_ms']:>7.1f} {r['p99_ttft_ms']:>7.1f} "
                    f"{r['mean_tpot_ms']:>6.1f} {r['mean_e2el_ms']:>9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
