"""The routing lab: every router, on a fresh fleet, under the same seeded workload.

For each (workload, rate, router) the lab starts N simulated engines (real ``infergate
engine serve --simulate`` processes with the workload's KV capacity and timing), starts the
router in front of them, sends the same seeded requests (same prompts, same arrival
times) through ``infergate bench serve``'s runner, and reads back, besides the client's
TTFT/E2E/throughput, what the engines themselves saw: their real prefix-cache hit rate
(``vllm:prefix_cache_hits`` / ``queries``), how evenly the requests spread (imbalance =
busiest engine's share ÷ the fair share), and how late their modelled steps ran
(``infergate_sim_late_seconds`` ÷ ``infergate_sim_modelled_seconds``). A lag over 10 %
means this machine could not keep the simulation faithful and the row is flagged.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from infergate.bench.datasets import Tokens
from infergate.bench.routing.routers import Router, RouterUnavailable
from infergate.bench.routing.workloads import Workload
from infergate.bench.runner import BenchConfig, run_benchmark
from infergate.procs import free_port
from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model, resolve_model

#: Counters read from every engine before and after a run.
ENGINE_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
    "infergate_sim_late_seconds_total",
    "infergate_sim_modelled_seconds_total",
    "infergate_sim_lora_loads_total",
)
LAG_WARNING = 0.10


@dataclass
class LabSpec:
    engines: int = 4
    num_prompts: int | None = None  # None: the workload's
    seed: int = 0
    output_dir: Path = Path("routing-lab")
    sim_args: Sequence[str] = ()  # extra engine flags, e.g. --sim-us-per-token 40
    output_len: int | None = None
    # The simulated engines' model (config and tokenizer; weights never load): a name
    # `engine fetch-model` knows, a .gguf or a model directory. None: the tiny model,
    # whose byte-level vocabulary makes about 1.2 characters per token where a real one
    # makes 4-6, so prompts of the same token length are 4-5x shorter in characters.
    model: Path | None = None


@dataclass
class RunResult:
    workload: str
    router: str
    rate: float
    completed: int = 0
    failed: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    e2e_p50_ms: float = 0.0
    e2e_p99_ms: float = 0.0
    output_tok_s: float = 0.0
    prefix_hit_rate: float = 0.0
    imbalance: float = 0.0
    sim_lag: float = 0.0
    skipped: str = ""
    lora_loads: float = 0.0  # adapters brought into a slot, all engines (LoRA workloads)
    per_engine_requests: list[float] = field(default_factory=list)

    @property
    def lag_warning(self) -> bool:
        return self.sim_lag > LAG_WARNING


def scrape_counters(url: str) -> dict[str, float]:
    """Sum of each counter in ENGINE_COUNTERS across its label sets (0 when absent)."""
    with urllib.request.urlopen(url, timeout=5.0) as response:
        text = response.read().decode()
    out = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def engine_count(workload: Workload, spec: LabSpec) -> int:
    """The workload's own fleet size (matrix cells have one), else the lab's."""
    return workload.engines or spec.engines


def fleet_spec(workload: Workload, spec: LabSpec) -> StackSpec:
    engine_args: list[str] = [*workload.engine_args, *spec.sim_args]
    engines = engine_count(workload, spec)
    if workload.kv_blocks is not None:
        engine_args += ["--num-gpu-blocks-override", str(workload.kv_blocks)]
    slow = ["--sim-base-ms", "12", "--sim-us-per-token", "60", "--sim-us-per-seq", "30"]
    per_engine = [slow if i < workload.slow_engines else [] for i in range(engines)]
    return StackSpec.on_free_ports(
        engines=engines,
        model=spec.model,
        access_log=False,
        engine_args=engine_args,
        per_engine_args=per_engine,
        lora=workload.lora,
        max_loras=workload.max_loras,
    )


def run_one(
    workload: Workload, router: Router, rate: float, spec: LabSpec, tokens: Tokens
) -> RunResult:
    """One router at one rate on a fresh fleet."""
    result = RunResult(workload.name, router.name, rate)
    n = spec.num_prompts or workload.num_prompts
    samples = workload.build(tokens, n, spec.seed)
    if spec.output_len is not None:
        for sample in samples:
            sample.output_len = spec.output_len
    fleet = fleet_spec(workload, spec)
    if router.kv_events:
        fleet.precise_prefix = True
        fleet.kv_events_ports = [free_port() for _ in range(engine_count(workload, spec))]
    stack = LocalStack(fleet)
    try:
        stack.start_engines()
        try:
            base_url = router.start(stack)
        except RouterUnavailable as error:
            result.skipped = str(error)
            return result
        metrics_urls = [f"{u}/metrics" for u in stack.engine_urls]
        before = [scrape_counters(u) for u in metrics_urls]
        report = asyncio.run(
            run_benchmark(
                BenchConfig(
                    base_url=base_url,
                    samples=samples,
                    endpoint=workload.endpoint,
                    model=stack.model_name,
                    request_rate=rate,
                    burstiness=workload.burstiness,
                    ignore_eos=True,
                    progress=False,
                    seed=spec.seed,
                )
            )
        )
        after = [scrape_counters(u) for u in metrics_urls]
        if stack.epp is not None:  # keep what the EPP learned, for a person to read
            spec.output_dir.mkdir(parents=True, exist_ok=True)
            name = f"epp-metrics-{workload.name}-{rate:g}-{router.name.replace(':', '_').replace('/', '_')}.txt"
            with urllib.request.urlopen(stack.epp_metrics_url, timeout=5.0) as response:
                (spec.output_dir / name).write_bytes(response.read())
    finally:
        stack.stop()
    _fill(result, report, before, after)
    return result


def _fill(
    result: RunResult,
    report: dict[str, Any],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
) -> None:
    result.completed = int(report["completed"])
    result.failed = int(report.get("failed", 0))
    result.ttft_p50_ms = float(report["median_ttft_ms"])
    result.ttft_p90_ms = float(report["p90_ttft_ms"])
    result.ttft_p99_ms = float(report["p99_ttft_ms"])
    result.e2e_p50_ms = float(report["median_e2el_ms"])
    result.e2e_p99_ms = float(report["p99_e2el_ms"])
    result.output_tok_s = float(report["output_throughput"])

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before, strict=True)]

    hits, queries = (
        sum(delta("vllm:prefix_cache_hits_total")),
        sum(delta("vllm:prefix_cache_queries_total")),
    )
    result.prefix_hit_rate = hits / queries if queries else 0.0
    served = delta("vllm:request_success_total")
    result.per_engine_requests = served
    total = sum(served)
    result.imbalance = max(served) / (total / len(served)) if total else 0.0
    result.lora_loads = sum(delta("infergate_sim_lora_loads_total"))
    modelled = sum(delta("infergate_sim_modelled_seconds_total"))
    result.sim_lag = sum(delta("infergate_sim_late_seconds_total")) / modelled if modelled else 0.0


def tokenizer_dir(model: Path | None) -> Path:
    """The directory holding ``tokenizer.json`` for the lab's model (see LabSpec.model)."""
    if model is None:
        return ensure_tiny_model()
    from infergate.engine.fetch import cache_dir
    from infergate.engine.gguf_model import find_gguf, prepare_model_dir

    resolved = resolve_model(model)
    gguf = find_gguf(resolved)
    return resolved if gguf is None else prepare_model_dir(gguf, cache_dir())


def run_lab(
    workloads: Sequence[Workload],
    routers: Sequence[Router],
    rates: Mapping[str, Sequence[float]],
    spec: LabSpec,
    on_result: Callable[[RunResult], None],
) -> list[RunResult]:
    """Every router at every rate of every workload; ``on_result`` sees each row as it lands."""
    tokens = Tokens(tokenizer_dir(spec.model))
    results: list[RunResult] = []
    for workload in workloads:
        for rate in rates.get(workload.name) or workload.rates:
            for router in routers:
                row = run_one(workload, router, rate, spec, tokens)
                results.append(row)
                on_result(row)
    return results
