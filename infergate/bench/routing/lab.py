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
import json
import os
import re
import signal
import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from infergate.bench.datasets import SampleRequest, Tokens
from infergate.bench.routing.routers import Router, RouterUnavailable
from infergate.bench.routing.sessions import SessionConfig, run_sessions
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
    #: EPP replica counts each EPP router runs with (a row per count).
    epp_replicas: Sequence[int] = (1,)
    #: Seconds into a multi-replica run at which EPP replica 1 is SIGKILLed (None: never).
    kill_epp_replica_at: float | None = None
    #: Also run each multi-replica count as a control: the replicas all run (scraping,
    #: subscribing) but Envoy dials only the first, so its row differs from the single
    #: replica's by the extra replicas' CPU alone.
    idle_control: bool = False


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
    #: How late the client sent its requests against their arrival times (ms, p99 and
    #: max): the client's own share of unfaithfulness, apart from the engines' ``sim_lag``.
    send_lag_p99_ms: float = 0.0
    send_lag_max_ms: float = 0.0
    skipped: str = ""
    lora_loads: float = 0.0  # adapters brought into a slot, all engines (LoRA workloads)
    #: Responses sessions: follow-up turns answered by the engine that served the turn
    #: before (same route tag in the response ids) over follow-ups sent; None otherwise.
    follow_ups_on_holder: float | None = None
    #: The first few distinct errors the client saw (a failed row says why).
    errors: list[str] = field(default_factory=list)
    per_engine_requests: list[float] = field(default_factory=list)
    epp_replicas: int = 1
    #: Failed requests that never reached an engine (Envoy's access log: an error and no
    #: upstream host); -1 when not counted (runs without a replica killed).
    failed_before_engine: int = -1

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


def fleet_spec(workload: Workload, spec: LabSpec, epp_replicas: int = 1) -> StackSpec:
    engine_args: list[str] = [*workload.engine_args, *spec.sim_args]
    engines = engine_count(workload, spec)
    if workload.kv_blocks is not None:
        engine_args += ["--num-gpu-blocks-override", str(workload.kv_blocks)]
    slow = ["--sim-base-ms", "12", "--sim-us-per-token", "60", "--sim-us-per-seq", "30"]
    per_engine = [slow if i < workload.slow_engines else [] for i in range(engines)]
    return StackSpec.on_free_ports(
        engines=engines,
        model=spec.model,
        simulate=True,  # a --model gives config and tokenizer; the lab never runs weights
        engine_args=engine_args,
        per_engine_args=per_engine,
        lora=workload.lora,
        max_loras=workload.max_loras,
        epp_replicas=epp_replicas,
        # The access log tells failed requests that reached an engine from those that did not.
        access_log=epp_replicas > 1 and spec.kill_epp_replica_at is not None,
    )


def _failed_before_engine(envoy_log: Path) -> int:
    """Requests Envoy answered with an error (or lost) without any upstream host."""
    failed = 0
    for line in envoy_log.read_text(errors="replace").splitlines():
        match = _ACCESS_LINE.search(line)
        if match and (int(match[1]) >= 500 or match[1] == "0") and match[2] == "-":
            failed += 1
    return failed


_ACCESS_LINE = re.compile(r'" (\d{1,3}) .*\bupstream=(\S+)')


def _killer(stack: LocalStack, after_s: float | None) -> threading.Timer | None:
    """A timer that SIGKILLs EPP replica 1 ``after_s`` seconds from its start."""
    if after_s is None or len(stack.epps) < 2 or stack.epps[1] is None:
        return None
    victim = stack.epps[1]

    def kill() -> None:
        if victim.alive():
            os.kill(victim.pid, signal.SIGKILL)

    return threading.Timer(after_s, kill)


def run_one(
    workload: Workload,
    router: Router,
    rate: float,
    spec: LabSpec,
    tokens: Tokens,
    epp_replicas: int = 1,
    control: bool = False,
) -> RunResult:
    """One router at one rate on a fresh fleet (an EPP router with ``epp_replicas``)."""
    name = router.name if epp_replicas == 1 else f"{router.name} x{epp_replicas}"
    if control:
        name += " idle-control"
    killing = epp_replicas > 1 and spec.kill_epp_replica_at is not None and not control
    if killing:
        name += f" kill@{spec.kill_epp_replica_at:g}s"
    result = RunResult(workload.name, name, rate, epp_replicas=epp_replicas)
    n = spec.num_prompts or workload.num_prompts
    samples = workload.build(tokens, n, spec.seed)
    if spec.output_len is not None:
        for sample in samples:
            sample.output_len = spec.output_len
    fleet = fleet_spec(workload, spec, epp_replicas)
    if control:
        fleet.envoy_epp_replicas = 1
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
        killer = _killer(stack, spec.kill_epp_replica_at) if killing else None
        if killer is not None:
            killer.start()
        report = asyncio.run(_drive(workload, samples, base_url, stack.model_name, rate, spec))
        after = [scrape_counters(u) for u in metrics_urls]
        if killer is not None:
            killer.cancel()
            assert stack.workdir is not None
            result.failed_before_engine = _failed_before_engine(stack.workdir / "envoy.log")
        spec.output_dir.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.@-]+", "_", result.router)
        _write_requests(spec.output_dir / f"requests-{workload.name}-{rate:g}-{safe}.json", report)
        if stack.epp is not None:  # keep what the EPP learned, for a person to read
            name = f"epp-metrics-{workload.name}-{rate:g}-{safe}.txt"
            with urllib.request.urlopen(stack.epp_metrics_url, timeout=5.0) as response:
                (spec.output_dir / name).write_bytes(response.read())
    finally:
        stack.stop()
    _fill(result, report, before, after)
    return result


def _write_requests(path: Path, report: dict[str, Any]) -> None:
    """Each request's prompt tokens, TTFT and error, in the workload's order (the same
    seed sends the same requests to every router, so rows pair up across files). TTFT
    less the prefill a request's length needs is the part routing decides: how one
    router's tail differs from another's is read from these, not from percentiles.
    Open-loop workloads only: a session workload's turns depend on earlier answers."""
    if "ttfts" not in report:
        return
    rows = {
        "prompt_tokens": report["input_lens"],
        "ttft_s": report["ttfts"],
        "error": report["errors"],
        "send_lag_s": report.get("send_lags", []),
    }
    path.write_text(json.dumps(rows))


async def _drive(
    workload: Workload,
    samples: list[SampleRequest],
    base_url: str,
    model: str,
    rate: float,
    spec: LabSpec,
) -> dict[str, Any]:
    """Send the workload: open-loop samples, or closed-loop sessions."""
    if workload.session_api:
        return await run_sessions(
            SessionConfig(
                base_url=base_url,
                samples=samples,
                api=workload.session_api,
                request_rate=rate,
                model=model,
                burstiness=workload.burstiness,
                seed=spec.seed,
            )
        )
    return await run_benchmark(
        BenchConfig(
            base_url=base_url,
            samples=samples,
            endpoint=workload.endpoint,
            model=model,
            request_rate=rate,
            burstiness=workload.burstiness,
            ignore_eos=True,
            progress=False,
            seed=spec.seed,
            arrivals=workload.arrivals[: len(samples)] if workload.arrivals else None,
        )
    )


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
    lags = sorted(report.get("send_lags") or [0.0])
    result.send_lag_p99_ms = 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    result.send_lag_max_ms = 1000 * lags[-1]
    result.errors = list(dict.fromkeys(e[:200] for e in report.get("errors", []) if e))[:3]
    if report.get("follow_ups"):
        result.follow_ups_on_holder = report["follow_ups_on_holder"] / report["follow_ups"]

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
    """The directory holding ``tokenizer.json`` for the lab's model (see LabSpec.model):
    fetched if it is a known name (the stack's resolution), then the directory the engines
    themselves serve it from (``engine serve``'s, a GGUF's derived one included)."""
    if model is None:
        return ensure_tiny_model()
    from infergate.engine.serve import ServeOptions
    from infergate.engine.serve import resolve_model as engine_model_dir

    return engine_model_dir(ServeOptions(model_dir=resolve_model(model)))


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
                counts = spec.epp_replicas if router.epp else (1,)
                runs = [(n, False) for n in counts]
                if router.epp and spec.idle_control:
                    runs += [(n, True) for n in counts if n > 1]
                for replicas, control in runs:
                    row = run_one(workload, router, rate, spec, tokens, replicas, control)
                    results.append(row)
                    on_result(row)
    return results
