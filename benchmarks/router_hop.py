"""What each router adds to one request's time to first byte, with the engine beside it.

Where a cell's TTFT p90 sits on a cold prompt's own prefill (the routing lab's KV-bound
cells, docs/benchmarks/routing.md), routers that place alike differ by what their hop
costs. This measures that hop alone: one simulated engine (``infergate engine serve
--simulate``), and in front of it Envoy + the EPP (``infergate up``'s gateway), Envoy
alone (the lab's ``round-robin``), sglang-router (``sglang-cache-aware``, when
installed) and, with ``--external-epp``, Envoy + llm-d-router's EPP (the lab's
``external-epp``: the same ext-proc architecture, compiled Go) on ports of its own.
Requests go one at a time, so nothing queues: each path is asked in turn for a fresh
prompt (cold: a full prefill) and then the same prompt again (cached), and a path's
figure is its TTFT minus the engine's own (``direct``). Streaming; TTFT is the first
response byte.

    .venv/bin/python benchmarks/router_hop.py [--requests 40] [--prompt-words 300] \
        [--external-epp ~/.cache/infergate/peers/llm-d-epp]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from infergate.bench.routing.routers import ROUTERS, Router, RouterUnavailable, external_router
from infergate.procs import free_ports
from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model

WARMUP = 5  # first rounds left out: connections and caches warming up


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice('abcdefgh')}{rng.randrange(10_000)}" for _ in range(words))


def _ttft_ms(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"{url}: HTTP {reply.status_code}: {reply.read()[:200]!r}")
        next(reply.iter_raw())
        return (time.perf_counter() - start) * 1e3


def _beside(stack: LocalStack, router: Router) -> str:
    """Start ``router``, which takes the stack's listener and EPP ports (the lab gives it
    a stack of its own), on fresh ones beside the stack's gateway; the stack keeps its own
    Envoy and EPP."""
    own = stack.spec, stack.epp, stack.envoy
    port, admin, grpc, health, metrics = free_ports(5)
    stack.spec = dataclasses.replace(
        stack.spec,
        port=port,
        admin_port=admin,
        epp_grpc_port=grpc,
        epp_health_port=health,
        epp_metrics_port=metrics,
    )
    try:
        return router.start(stack)
    finally:
        stack.spec, stack.epp, stack.envoy = own


def _paths(stack: LocalStack, external_epp: Path | None) -> dict[str, str]:
    paths = {"direct": stack.engine_urls[0], "envoy+epp": stack.base_url}
    routers = [("envoy", ROUTERS["round-robin"]), ("sglang-router", ROUTERS["sglang-cache-aware"])]
    if external_epp is not None:
        routers.append(("envoy+llm-d-epp", external_router(external_epp)))
    for label, router in routers:
        try:
            paths[label] = (
                _beside(stack, router) if router.name == "external-epp" else router.start(stack)
            )
        except RouterUnavailable as why:
            print(f"{label}: skipped ({why})")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="cold/cached pairs per path")
    parser.add_argument("--prompt-words", type=int, default=300, help="words per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--external-epp",
        type=Path,
        default=None,
        help="llm-d-router's EPP binary (tools/peers/build_llmd_epp.sh): adds its path",
    )
    args = parser.parse_args()
    if args.requests < WARMUP + 2 or args.prompt_words < 1:
        # a p90 needs two requests past the warm-up
        parser.error(f"--requests must be >= {WARMUP + 2} and --prompt-words >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="router-hop-"))
    spec = StackSpec.on_free_ports(
        engines=1,
        model=ensure_tiny_model(workdir / "model"),
        served_model_name="tiny",
        simulate=True,
        workdir=workdir,
        start_timeout=180.0,
    )
    rng = random.Random(args.seed)
    times: dict[tuple[str, str], list[float]] = {}
    with LocalStack(spec) as stack, httpx.Client(timeout=60) as client:
        paths = _paths(stack, args.external_epp)
        for _ in range(args.requests):
            for label, url in paths.items():
                prompt = _prompt(rng, args.prompt_words)
                for kind in ("cold", "cached"):
                    times.setdefault((label, kind), []).append(_ttft_ms(client, url, prompt))
                    time.sleep(0.03)  # the engine idle again: nothing queues
    print(f"{'path':16s} {'kind':7s} {'TTFT p50':>9s} {'p90':>7s} {'added p50':>10s}")
    for (label, kind), values in times.items():
        kept = values[WARMUP:]
        p50 = statistics.median(kept)
        p90 = statistics.quantiles(kept, n=10)[-1]
        added = p50 - statistics.median(times[("direct", kind)][WARMUP:])
        print(f"{label:16s} {kind:7s} {p50:9.1f} {p90:7.1f} {added:+10.2f} ms")


if __name__ == "__main__":
    main()
