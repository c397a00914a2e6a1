"""``infergate bench``: serving benchmarks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from infergate.bench.options import BenchServeOptions, RoutingLabOptions
from infergate.options import SeveralValues, command

if TYPE_CHECKING:
    from rich.console import Console

    from infergate.bench.datasets import SampleRequest
    from infergate.bench.routing.lab import RunResult
    from infergate.bench.routing.routers import Router
    from infergate.bench.routing.traces import TraceOptions
    from infergate.bench.routing.workloads import Workload
    from infergate.bench.runner import BenchConfig

app = typer.Typer(help="Benchmarks that print numbers (never timed tests).", no_args_is_help=True)


@app.command("serve", cls=SeveralValues)
@command(BenchServeOptions)
def serve(options: BenchServeOptions) -> None:
    """Load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E and throughput.

    Metrics follow `vllm bench serve`'s definitions and key names, so results compare.
    Ctrl-C prints the summary over the requests that finished, marked partial (exit 130).
    """
    import asyncio
    import json

    from rich.console import Console

    from infergate.bench.metrics import format_summary
    from infergate.bench.runner import Interrupted, run_benchmark

    console = Console(stderr=True)
    interrupted = False
    try:
        result = asyncio.run(run_benchmark(_bench_config(options)))
    except Interrupted as stop:
        result, interrupted = stop.result, True
    except (ValueError, RuntimeError, OSError) as error:
        console.print(
            f"bench serve: {error}", style="red", markup=False, highlight=False, soft_wrap=True
        )
        raise typer.Exit(1) from None
    result["dataset"] = options.dataset
    typer.echo(format_summary(result, percentiles=options.percentiles))
    failed = [e for e in result["errors"] if e]
    if failed:
        console.print(
            f"{len(failed)} request(s) failed; first: {failed[0]}", markup=False, soft_wrap=True
        )
    if options.result_file is not None:
        options.result_file.write_text(json.dumps(result, indent=2))
        console.print(f"results written to {options.result_file}", markup=False, soft_wrap=True)
    if interrupted:
        raise typer.Exit(130)  # a shell's code for SIGINT, as an uncaught Ctrl-C gives


def _bench_config(o: BenchServeOptions) -> BenchConfig:
    """The runner's config: the dataset's samples and the load (ValueError: a bad dataset)."""
    from infergate.bench.runner import BenchConfig

    return BenchConfig(
        base_url=o.base_url, samples=_samples(o), endpoint=o.endpoint, model=o.model,
        request_rate=o.request_rate, burstiness=o.burstiness,
        max_concurrency=o.max_concurrency, seed=o.seed, ignore_eos=o.ignore_eos,
        temperature=o.temperature, headers=o.headers, percentiles=o.percentiles,
        goodput_slos_ms=o.goodput, progress=not o.disable_tqdm,
    )  # fmt: skip


def _samples(o: BenchServeOptions) -> list[SampleRequest]:
    """``--dataset``'s requests: random, shared-prefix, or a JSONL file."""
    from infergate.bench.datasets import (
        Tokens,
        jsonl_dataset,
        random_dataset,
        shared_prefix_dataset,
    )

    tokens = Tokens(o.tokenizer)
    if o.dataset == "random":
        return random_dataset(
            o.num_prompts, o.input_len, o.output_len, range_ratio=o.range_ratio, tokens=tokens,
            seed=o.seed,
        )  # fmt: skip
    if o.dataset == "shared-prefix":
        return shared_prefix_dataset(
            o.num_prompts, num_groups=o.num_prefix_groups, prefix_len=o.prefix_len,
            suffix_len=o.input_len, output_len=o.output_len, tokens=tokens, seed=o.seed,
        )  # fmt: skip
    if Path(o.dataset).is_file():
        return jsonl_dataset(Path(o.dataset), o.num_prompts, o.output_len, tokens)
    raise ValueError(f"--dataset {o.dataset!r}: not random, shared-prefix, or a file")


@app.command("routing")
@command(RoutingLabOptions)
def routing(options: RoutingLabOptions) -> None:
    """The routing lab: each router on a fresh simulated fleet, same seeded workload.

    Starts N real `infergate engine serve --simulate` processes per run, puts one router in
    front (Envoy round robin / least request, sglang-router cache_aware, the EPP with GIE's
    or infergate's default profile, or your EndpointPickerConfig), sends the workload, and
    prints TTFT/E2E percentiles, output throughput, the engines' real prefix-cache hit
    rate, load imbalance and how late the simulated steps ran. Writes results.json, one
    PNG per workload (TTFT p90 and throughput vs rate) and, per row, each request's prompt
    tokens and TTFT in the workload's order to --output-dir. Use it as a what-if
    simulator before changing scorer weights in production.
    """
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file or CI: no wrapping of the wide table
        console = Console(width=180)
    o = options
    if o.trace.trace is not None:
        if o.matrix is not None or o.rates:
            raise typer.BadParameter("a trace sets its own arrivals", param_hint="--matrix/--rates")
        chosen, names, trace_meta = _trace_workloads(o.trace, console)
    else:
        chosen, names = _lab_workloads(o.workload, o.matrix, o.cells, o.rates)
        trace_meta = None
    routers = _routers(o)
    if o.seed is None:
        o.seed = random.SystemRandom().randrange(2**31)
    console.print(f"seed {o.seed} (rerun with --seed {o.seed})", markup=False)
    results = _run_lab(o, chosen, routers, console)
    meta: dict[str, object] = {
        "engines": o.engines, "seed": o.seed, "matrix": o.matrix, "workloads": names,
        "routers": [r.name for r in routers], "model": str(o.model) if o.model else "tiny",
        "trace": trace_meta,
    }  # fmt: skip
    _report_lab(results, meta, o, console)


def _routers(o: RoutingLabOptions) -> list[Router]:
    """The routers to compare: ``--router``'s, or the default set (plus the external EPP
    when its binary is given)."""
    from infergate.bench.routing.routers import DEFAULT_ROUTERS, resolve

    wanted = o.router or [*DEFAULT_ROUTERS, *(["external-epp"] if o.external_epp else [])]
    try:
        return [
            resolve(n, external_epp=o.external_epp, external_epp_config=o.external_epp_config)
            for n in wanted
        ]
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--router") from None


def _run_lab(
    o: RoutingLabOptions, chosen: list[Workload], routers: list[Router], console: Console
) -> list[RunResult]:
    """Every (workload, rate, router) run, each row printed as it lands."""
    from rich.progress import Progress

    from infergate.bench.routing.lab import LabSpec, run_lab
    from infergate.bench.routing.report import row_cells

    assert o.seed is not None
    per_workload = {w.name: o.rates or list(w.rates) for w in chosen}
    extra = sum(1 for n in o.epp_replicas if n > 1) if o.epp_idle_control else 0
    runs_per_rate = sum(len(o.epp_replicas) + extra if r.epp else 1 for r in routers)
    total = sum(len(per_workload[w.name]) for w in chosen) * runs_per_rate
    spec = LabSpec(
        engines=o.engines, num_prompts=o.num_prompts, seed=o.seed, output_dir=o.output_dir,
        sim_args=o.sim_arg, output_len=o.output_len, model=o.model,
        epp_replicas=o.epp_replicas, kill_epp_replica_at=o.kill_epp_replica_at,
        idle_control=o.epp_idle_control,
    )  # fmt: skip
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("routing lab", total=total)

        def landed(row: object) -> None:
            progress.console.print("  ".join(c for c in row_cells(row) if c))  # type: ignore[arg-type]
            progress.advance(task)

        try:
            return run_lab(chosen, routers, per_workload, spec, landed)
        except (RuntimeError, OSError) as error:
            console.print(f"bench routing: {error}", style="red", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None


def _report_lab(
    results: list[RunResult], meta: dict[str, object], o: RoutingLabOptions, console: Console
) -> None:
    """The summary tables, results.json and the plots (the regret heat map for a matrix)."""
    from infergate.bench.routing.report import (
        faithfulness,
        plot,
        plot_regret,
        print_faithfulness,
        print_regret,
        print_summary,
        write_json,
    )

    print_summary(results, console)
    print_faithfulness(results, console)
    write_json(
        results, o.output_dir / "results.json", {**meta, "faithfulness": faithfulness(results)}
    )
    if o.matrix is None:
        plots = plot(results, o.output_dir)
    else:
        print_regret(results, console)
        heat = plot_regret(results, o.output_dir)
        plots = [heat] if heat else []
    console.print(f"results: {o.output_dir / 'results.json'}; plots: {', '.join(map(str, plots))}")


def _trace_workloads(
    opts: TraceOptions, console: Console
) -> tuple[list[Workload], list[str], dict[str, object]]:
    """The trace's windows as workloads: the given ones, then one per seed (drawn and
    printed when neither is given), each printed with its seed, requests and ceiling."""
    from infergate.bench.routing import traces

    assert opts.trace is not None
    try:
        trace = traces.read_trace(opts.trace)
        windows = traces.parse_windows(opts.windows)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--trace/--trace-window") from None
    seeds = list(opts.seeds)
    if not windows and not seeds:
        seeds = [random.SystemRandom().randrange(2**31) for _ in range(opts.count)]
    windows += [traces.window_for_seed(trace, opts.window_seconds, s) for s in seeds]
    replay = traces.Replay(opts.speedup, opts.scale, opts.max_output)
    name = opts.trace.stem
    chosen: list[Workload] = []
    described = []
    for window in windows:
        try:
            chosen.append(traces.window_workload(name, trace, window, replay, opts.profile))
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--trace-window/--trace-seed") from None
        requests = traces.in_window(trace, window)
        ceiling = traces.prefix_ceiling(requests)
        seed = f"seed {window.seed}" if window.seed is not None else "given"
        console.print(
            f"trace window {window.label} ({seed}): {len(requests)} requests, prefix-hit "
            f"ceiling {ceiling:.1%}; rerun with --trace-window {window.start_s:g}:"
            f"{window.seconds:g}",
            markup=False,
        )
        described.append({"start_s": window.start_s, "seconds": window.seconds,
                          "seed": window.seed, "requests": len(requests),
                          "prefix_ceiling": ceiling})  # fmt: skip
    console.print(
        f"replay: scale {replay.scale:g}, speed-up {replay.speedup:g}, output cap "
        f"{replay.max_output or 'none'}, engines {opts.profile}",
        markup=False,
    )
    meta: dict[str, object] = {
        "file": str(opts.trace), "windows": described, "scale": replay.scale,
        "speedup": replay.speedup, "max_output": replay.max_output, "gpu_profile": opts.profile,
    }  # fmt: skip
    return chosen, [w.name for w in chosen], meta


def _lab_workloads(
    workload: list[str], matrix: str | None, cells: str | None, rates: list[float] | None
) -> tuple[list[Workload], list[str]]:
    """The lab's workloads: the matrix cells when ``--matrix`` is given, else the presets."""
    from infergate.bench.routing import matrix as lab_matrix
    from infergate.bench.routing.workloads import WORKLOADS

    if matrix is not None:
        if rates:
            raise typer.BadParameter("each matrix cell sets its own rate", param_hint="--rates")
        try:
            chosen_cells = lab_matrix.select(matrix, cells)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--matrix/--cells") from None
        return [lab_matrix.workload(c) for c in chosen_cells], [c.name for c in chosen_cells]
    if cells:
        raise typer.BadParameter("--cells needs --matrix", param_hint="--cells")
    names = list(WORKLOADS) if "all" in workload else workload
    try:
        return [WORKLOADS[n] for n in names], names
    except KeyError as error:
        raise typer.BadParameter(
            f"unknown workload {error.args[0]!r}; choose from {', '.join(WORKLOADS)} or all",
            param_hint="--workload",
        ) from None


@app.command("regret")
def regret(
    results: list[Path] = typer.Argument(
        ..., help="results.json files of `bench routing --matrix` runs (e.g. its parts)."
    ),
    output_dir: Path = typer.Option(
        Path("routing-lab"), "--output-dir", help="Where routing-regret.png goes."
    ),
) -> None:
    """Regret over several matrix runs: each router's TTFT p90/p99 ÷ the best router's in
    each cell, worst and mean, and against the better of round robin and least request.

    Run a long matrix in parts (`bench routing --matrix standard --cells 0-6`, then
    `--cells 7-13`) and combine them here. Cells where not every router ran are left out.
    """
    from rich.console import Console

    from infergate.bench.routing.report import (
        plot_regret,
        print_regret,
        read_json,
        regret_markdown,
        regrets,
    )

    rows = []
    for path in results:
        try:
            rows.extend(read_json(path))
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="RESULTS") from None
    console = Console()
    print_regret(rows, console)
    typer.echo(regret_markdown(regrets(rows)))
    heat = plot_regret(rows, output_dir)
    if heat:
        console.print(f"heat map: {heat}", markup=False)
