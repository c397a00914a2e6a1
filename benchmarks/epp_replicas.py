"""EPP replicas measured in a way 2 cores can show (issue 46, item 4).

The earlier attempt (docs/benchmarks/scale.md, "Decisions a second") compared TTFT and
decisions/s of 1 and 4 replicas on a machine whose 2 cores also ran the engines, Envoy
and the client: 3 more processes slowed everything, whatever the routing did. This one
measures what replication itself costs, with every replica set pinned by ``taskset`` to
the same core set (``--cores``, one core by default) as the single EPP:

* **CPU per decision, summed over the replicas**: Σ CPU time of every thread of every EPP
  process over the run (``/proc/PID/task/TID/schedstat``, in ns: ``/proc/PID/stat``
  counts whole clock ticks per process, so 4 processes rounded off up to 40 ms of a
  ~400 ms row) ÷ the requests routed. ``--threads`` prints it per thread. Each replica pays its own background work (its
  process's idle timers and threads, receiving every engine's load reports and the
  admission records that carry prefixes, read at its decisions), so N replicas cost more
  per decision than one; the target is at most 1.15× one replica's.
* **Prefix hit rate** of the engines over the run (their ``vllm:prefix_cache_*``
  counters), within 2 points of one replica's: the replicas share what each routed
  through the engines' admission records (docs/epp.md, "Several replicas").
* TTFT p50/p90/p99 and the simulator's lateness, for reading the rows, as the lab gives them.
* ``--idle SECONDS``: no requests; each row's CPU and timeslices over that long, what a
  replica costs when it routes nothing (its timers, Envoy's health checks).

Each row is the routing lab's ``run_one`` setup (fresh fleet of simulated engines, real
Envoy, ``infergate epp`` replicas behind Envoy's ext_proc cluster), the same requests for
every row (``--seed``), rows interleaved (1, N, N, 1, ...) so load drift hits both.

    .venv/bin/python benchmarks/epp_replicas.py [--replicas 1,4] [--rounds 1] \\
        [--workload tight-prefix] [--rate 10] [--requests 200] [--cores 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from dataclasses import dataclass

from infergate.bench.routing import lab
from infergate.bench.routing.routers import resolve
from infergate.bench.routing.workloads import WORKLOADS
from infergate.stack.local import LocalStack


@dataclass
class Row:
    replicas: int
    requests: int
    failed: int
    errors: list[str]
    cpu_s: float
    hit: float
    ttft: tuple[float, float, float]
    sim_lag: float
    #: CPU ms and timeslices over the run per thread name, summed over the replicas.
    threads: dict[str, tuple[float, int]]

    @property
    def cpu_ms_per_decision(self) -> float:
        return 1e3 * self.cpu_s / max(1, self.requests)


Threads = dict[tuple[int, int], tuple[str, int, int]]


def _thread_ns(pids: list[int]) -> Threads:
    """Per thread of ``pids``: its name (``main`` for the main thread), ns on CPU and
    timeslices run (``/proc/PID/task/TID/schedstat``: a slice is about a wakeup)."""
    threads: Threads = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    name = "main" if int(tid) == pid else comm.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                    ns, _wait, slices = stat.read().split()[:3]
            except OSError:  # the thread ended meanwhile
                continue
            threads[(pid, int(tid))] = (name, int(ns), int(slices))
    return threads


def _thread_ms(before: Threads, after: Threads) -> dict[str, tuple[float, int]]:
    """CPU ms and timeslices per thread name between two :func:`_thread_ns` samples
    (threads that started meanwhile whole, those that ended not at all)."""
    by_name: dict[str, tuple[float, int]] = {}
    for key, (name, ns, slices) in after.items():
        _, ns0, slices0 = before.get(key, (name, 0, 0))
        ms, count = by_name.get(name, (0.0, 0))
        by_name[name] = (ms + (ns - ns0) / 1e6, count + slices - slices0)
    return by_name


def _epp_pids(stack: LocalStack) -> list[int]:
    return [p.pid for p in stack.epps if p is not None]


def _pin(pids: list[int], cores: str) -> None:
    """``taskset -a -p -c CORES PID``: every thread of each EPP on the same core set."""
    for pid in pids:
        subprocess.run(["taskset", "-a", "-p", "-c", cores, str(pid)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip


def run_row(replicas: int, args: argparse.Namespace, tokens: lab.Tokens) -> Row:
    workload = WORKLOADS[args.workload]
    router = resolve(args.router)
    spec = lab.LabSpec(seed=args.seed, num_prompts=args.requests, output_dir=args.output_dir)
    samples = workload.build(tokens, args.requests, args.seed)
    stack = LocalStack(lab.fleet_spec(workload, spec, replicas))
    try:
        stack.start_engines()
        base_url = router.start(stack)
        pids = _epp_pids(stack)
        assert len(pids) == replicas, f"{len(pids)} EPP processes for {replicas} replicas"
        _pin(pids, args.cores)
        urls = [f"{u}/metrics" for u in stack.engine_urls]
        before = [lab.scrape_counters(u) for u in urls]
        threads0 = _thread_ns(pids)
        if args.idle:
            time.sleep(args.idle)
            report: dict[str, object] = {}
        else:
            report = asyncio.run(
                lab._drive(workload, samples, base_url, stack.model_name, args.rate, spec)
            )
        threads = _thread_ms(threads0, _thread_ns(pids))
        cpu = sum(ms for ms, _ in threads.values()) / 1e3
        after = [lab.scrape_counters(u) for u in urls]
    finally:
        stack.stop()
    result = lab.RunResult(workload.name, router.name, args.rate, epp_replicas=replicas)
    if report:
        lab._fill(result, report, before, after)
    return Row(
        replicas,
        result.completed + result.failed,
        result.failed,
        result.errors,
        cpu,
        result.prefix_hit_rate,
        (result.ttft_p50_ms, result.ttft_p90_ms, result.ttft_p99_ms),
        result.sim_lag,
        threads,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,4", help="replica counts; the first is the base")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of interleaved rows")
    parser.add_argument("--workload", default="tight-prefix", choices=sorted(WORKLOADS))
    parser.add_argument("--router", default="epp-infergate")
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cores", default="1", help="taskset core list every EPP runs on")
    parser.add_argument(
        "--threads",
        action="store_true",
        help="also print each row's CPU per thread name (schedstat)",
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="send no requests: each row measures its replicas idle for this long (what a "
        "replica costs when it routes nothing: its timers and Envoy's health checks)",
    )
    parser.add_argument("--output-dir", type=lab.Path, default=lab.Path("/tmp/epp-replicas"))
    args = parser.parse_args()
    counts = [int(c) for c in args.replicas.split(",")]
    if not counts or min(counts) < 1:
        parser.error("--replicas: replica counts of at least 1")
    tokens = lab.Tokens(lab.tokenizer_dir(None))
    print(f"load average before: {os.getloadavg()}, cpus {os.cpu_count()}", flush=True)
    rows: list[Row] = []
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            row = run_row(n, args, tokens)
            rows.append(row)
            if args.idle:
                slices = sum(count for _, count in row.threads.values())
                print(
                    f"replicas {row.replicas} idle {args.idle:g} s: EPP CPU {1e3 * row.cpu_s:.1f} "
                    f"ms summed ({1e3 * row.cpu_s / args.idle / n:.2f} ms/s a replica), "
                    f"{slices} timeslices ({slices / args.idle / n:.1f}/s a replica)",
                    flush=True,
                )
                continue
            print(
                f"replicas {row.replicas}: {row.requests} requests ({row.failed} failed"
                f"{': ' + row.errors[0] if row.errors else ''}), EPP CPU {row.cpu_s:.2f} s "
                f"= {row.cpu_ms_per_decision:.3f} ms/decision (summed), hit {row.hit:.1%}, "
                f"TTFT p50/p90/p99 {row.ttft[0]:.0f}/{row.ttft[1]:.0f}/{row.ttft[2]:.0f} ms, "
                f"sim lag {row.sim_lag:.1%}",
                flush=True,
            )
            if args.threads:
                busiest = sorted(row.threads.items(), key=lambda kv: -kv[1][0])
                print(
                    "  threads, CPU ms / timeslices summed over replicas: "
                    + ", ".join(f"{name} {ms:.0f}/{n}" for name, (ms, n) in busiest if ms >= 0.5),
                    flush=True,
                )
    if args.idle:
        print(f"load average after: {os.getloadavg()}", flush=True)
        return
    base = [r for r in rows if r.replicas == counts[0]]
    base_cpu = sum(r.cpu_s for r in base) / max(1, sum(r.requests for r in base))
    base_hit = sum(r.hit for r in base) / len(base)
    for n in counts[1:]:
        mine = [r for r in rows if r.replicas == n]
        cpu = sum(r.cpu_s for r in mine) / max(1, sum(r.requests for r in mine))
        hit = sum(r.hit for r in mine) / len(mine)
        print(
            f"{n} replicas vs {counts[0]}: summed CPU per decision {cpu / base_cpu:.2f}x "
            f"(target <= 1.15x), hit rate {100 * (hit - base_hit):+.1f} points (target within 2)",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
