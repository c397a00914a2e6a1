"""The lab's output: a terminal table, a JSON file, and plots (TTFT p90 and throughput vs
request rate, one line per router, one figure per workload)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from infergate.bench.routing.lab import LAG_WARNING, RunResult

COLUMNS = (
    ("workload", "workload"),
    ("rate", "req/s"),
    ("router", "router"),
    ("ok", "ok"),
    ("failed", "fail"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p90_ms", "TTFT p90"),
    ("ttft_p99_ms", "TTFT p99"),
    ("e2e_p50_ms", "E2E p50"),
    ("e2e_p99_ms", "E2E p99"),
    ("output_tok_s", "out tok/s"),
    ("prefix_hit_rate", "hit rate"),
    ("imbalance", "imbalance"),
    ("sim_lag", "sim lag"),
    ("send_lag_p99_ms", "send lag p99"),
    ("follow_ups_on_holder", "on holder"),
)


def row_cells(r: RunResult) -> list[str]:
    if r.skipped:
        return [r.workload, f"{r.rate:g}", r.router, "-", "-", f"skipped: {r.skipped}"] + [""] * 10
    lag = f"{r.sim_lag:.1%}" + (" !" if r.lag_warning else "")
    return [
        r.workload,
        f"{r.rate:g}",
        r.router,
        str(r.completed),
        str(r.failed)
        + (f" ({r.failed_before_engine} pre-engine)" if r.failed_before_engine >= 0 else ""),
        f"{r.ttft_p50_ms:.0f}",
        f"{r.ttft_p90_ms:.0f}",
        f"{r.ttft_p99_ms:.0f}",
        f"{r.e2e_p50_ms:.0f}",
        f"{r.e2e_p99_ms:.0f}",
        f"{r.output_tok_s:.0f}",
        f"{r.prefix_hit_rate:.1%}",
        f"{r.imbalance:.2f}",
        lag,
        f"{r.send_lag_p99_ms:.0f}",
        "-" if r.follow_ups_on_holder is None else f"{r.follow_ups_on_holder:.1%}",
    ]


def table(results: Sequence[RunResult]) -> Table:
    t = Table(title="routing lab (times in ms)", show_lines=False)
    for _, title in COLUMNS:
        t.add_column(title, justify="left" if title in ("workload", "router") else "right")
    for r in results:
        t.add_row(*row_cells(r))
    return t


def print_summary(results: Sequence[RunResult], console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(results))
    lagging = [r for r in results if r.lag_warning and not r.skipped]
    if lagging:
        console.print(
            f"[yellow]warning:[/] {len(lagging)} run(s) had simulated steps more than "
            f"{LAG_WARNING:.0%} late ('!'): this machine could not keep the engines' timing "
            "model; compare ratios within a run, use fewer engines or a lower rate."
        )


#: Rows of one comparison (same workload and rate) whose engines ran later than the
#: comparison's least-late row by more than this (late ÷ modelled seconds) are flagged:
#: their TTFT includes the machine's lag, not only the router's decisions.
LAG_SPREAD_BOUND = 0.05
#: The same for the client's p99 send lag (ms).
SEND_LAG_SPREAD_BOUND_MS = 50.0


def faithfulness(results: Sequence[RunResult]) -> list[str]:
    """One line per row whose simulator lateness or client send lag exceeds its
    comparison's least-late row by more than the stated bounds, naming the row. Rows are
    kept, not dropped: a router whose own CPU slows the engines beside it (a peer's Go
    EPP on a small machine) is reported as such, and its TTFT read with that in mind."""
    lines = []
    for (workload, rate), rows in _comparisons(results).items():
        calm = min(rows, key=lambda r: r.sim_lag)
        for r in rows:
            if r.sim_lag - calm.sim_lag > LAG_SPREAD_BOUND:
                lines.append(
                    f"{workload} @ {rate:g}: the engines ran {r.sim_lag:.1%} late beside "
                    f"{r.router}, against {calm.sim_lag:.1%} beside {calm.router} (bound "
                    f"{LAG_SPREAD_BOUND:.0%}): {r.router}'s row is not like for like; its "
                    "own CPU (or the machine's load during it) slowed the simulated engines"
                )
        prompt = min(rows, key=lambda r: r.send_lag_p99_ms)
        for r in rows:
            if r.send_lag_p99_ms - prompt.send_lag_p99_ms > SEND_LAG_SPREAD_BOUND_MS:
                lines.append(
                    f"{workload} @ {rate:g}: the client sent {r.router}'s requests up to "
                    f"{r.send_lag_p99_ms:.0f} ms late (p99), against "
                    f"{prompt.send_lag_p99_ms:.0f} ms for {prompt.router} (bound "
                    f"{SEND_LAG_SPREAD_BOUND_MS:g} ms)"
                )
    return lines


def _comparisons(results: Sequence[RunResult]) -> dict[tuple[str, float], list[RunResult]]:
    groups: dict[tuple[str, float], list[RunResult]] = {}
    for r in results:
        if not r.skipped and r.completed:
            groups.setdefault((r.workload, r.rate), []).append(r)
    return groups


def print_faithfulness(results: Sequence[RunResult], console: Console | None = None) -> None:
    lines = faithfulness(results)
    if lines:
        console = console or Console()
        for line in lines:
            console.print(f"unfaithful comparison: {line}", style="yellow", markup=False)


def write_json(results: Sequence[RunResult], path: Path, meta: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))


def read_json(path: Path) -> list[RunResult]:
    """The rows of a results.json the lab wrote (ValueError naming the file if it is not one)."""
    try:
        data = json.loads(path.read_text())
        return [RunResult(**row) for row in data["results"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a routing-lab results.json ({error})") from None


def plot(results: Sequence[RunResult], directory: Path) -> list[Path]:
    """One PNG per workload: TTFT p90 and output throughput against request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload and not r.skipped]
        if not rows:
            continue
        fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
        for router in dict.fromkeys(r.router for r in rows):
            mine = sorted((r for r in rows if r.router == router), key=lambda r: r.rate)
            rates = [r.rate for r in mine]
            ax_ttft.plot(rates, [r.ttft_p90_ms for r in mine], marker="o", label=router)
            ax_tput.plot(rates, [r.output_tok_s for r in mine], marker="o", label=router)
        ax_ttft.set(xlabel="request rate (req/s)", ylabel="TTFT p90 (ms)", title=workload)
        ax_tput.set(xlabel="request rate (req/s)", ylabel="output tokens/s", title=workload)
        ax_ttft.set_yscale("log")
        for ax in (ax_ttft, ax_tput):
            ax.grid(True, alpha=0.3)
        ax_ttft.legend(fontsize=8)
        fig.tight_layout()
        path = directory / f"routing-{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


#: The baselines every router must not lose to: Envoy's own load balancers.
BASELINES = ("round-robin", "least-request")


@dataclass(frozen=True)
class Regret:
    """One router's regret over a set of cells: its TTFT percentile over the best router's
    in the same cell (1.0: it was the best there), the worst and the mean over cells; and
    the worst against the better of round robin and least request in each cell."""

    router: str
    cells: int
    p90_worst: float
    p90_mean: float
    p99_worst: float
    p99_mean: float
    p90_vs_baseline: float
    p99_vs_baseline: float


def _by_cell(results: Sequence[RunResult]) -> dict[tuple[str, float], dict[str, RunResult]]:
    cells: dict[tuple[str, float], dict[str, RunResult]] = {}
    for r in results:
        if not r.skipped and r.completed:
            cells.setdefault((r.workload, r.rate), {})[r.router] = r
    return cells


def regrets(results: Sequence[RunResult]) -> list[Regret]:
    """Each router's regret over the cells where every router of the run completed.

    ``regret(router, cell) = ttft_pXX(router, cell) ÷ min over routers of ttft_pXX(·, cell)``;
    the baseline regret divides by ``min(round robin, least request)`` instead (cells
    without either baseline count as 1)."""
    cells = _by_cell(results)
    routers = list(dict.fromkeys(r.router for r in results if not r.skipped))
    complete = [rows for rows in cells.values() if set(routers) <= set(rows)]
    out: list[Regret] = []
    for router in routers:
        p90: list[float] = []
        p99: list[float] = []
        base90: list[float] = []
        base99: list[float] = []
        for rows in complete:
            mine = rows[router]
            p90.append(mine.ttft_p90_ms / max(1e-9, min(r.ttft_p90_ms for r in rows.values())))
            p99.append(mine.ttft_p99_ms / max(1e-9, min(r.ttft_p99_ms for r in rows.values())))
            base = [rows[b] for b in BASELINES if b in rows]
            if base:
                base90.append(mine.ttft_p90_ms / max(1e-9, min(b.ttft_p90_ms for b in base)))
                base99.append(mine.ttft_p99_ms / max(1e-9, min(b.ttft_p99_ms for b in base)))
        if not p90:
            continue
        out.append(
            Regret(
                router,
                len(p90),
                max(p90),
                sum(p90) / len(p90),
                max(p99),
                sum(p99) / len(p99),
                max(base90, default=1.0),
                max(base99, default=1.0),
            )
        )
    return out


def regret_markdown(rows: Sequence[Regret]) -> str:
    head = (
        "| router | cells | p90 regret worst | p90 regret mean | p99 regret worst | "
        "p99 regret mean | p90 vs best of RR/LR (worst) | p99 vs best of RR/LR (worst) |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for g in rows:
        lines.append(
            f"| {g.router} | {g.cells} | {g.p90_worst:.2f} | {g.p90_mean:.2f} | "
            f"{g.p99_worst:.2f} | {g.p99_mean:.2f} | {g.p90_vs_baseline:.2f} | "
            f"{g.p99_vs_baseline:.2f} |"
        )
    return "\n".join(lines)


def print_regret(results: Sequence[RunResult], console: Console | None = None) -> None:
    rows = regrets(results)
    if not rows or rows[0].cells < 1:
        return
    console = console or Console()
    t = Table(title="regret: TTFT percentile / best router's in the same cell")
    for title in ("router", "cells", "p90 worst", "p90 mean", "p99 worst", "p99 mean",
                  "p90 vs RR/LR", "p99 vs RR/LR"):  # fmt: skip
        t.add_column(title, justify="left" if title == "router" else "right")
    for g in rows:
        t.add_row(
            g.router, str(g.cells), f"{g.p90_worst:.2f}", f"{g.p90_mean:.2f}",
            f"{g.p99_worst:.2f}", f"{g.p99_mean:.2f}", f"{g.p90_vs_baseline:.2f}",
            f"{g.p99_vs_baseline:.2f}",
        )  # fmt: skip
    console.print(t)


def plot_regret(results: Sequence[RunResult], directory: Path) -> Path | None:
    """A heat map per percentile: routers × cells, colour = regret (1 = best in the cell)."""
    cells = _by_cell(results)
    routers = list(dict.fromkeys(r.router for r in results if not r.skipped))
    keys = [k for k, rows in cells.items() if set(routers) <= set(rows)]
    if not keys or not routers:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(keys) + 3), 2 + 1.1 * len(routers)))
    for ax, field, title in zip(axes, ("ttft_p90_ms", "ttft_p99_ms"), ("p90", "p99"), strict=True):
        grid = []
        for router in routers:
            row = []
            for key in keys:
                best = min(getattr(r, field) for r in cells[key].values())
                row.append(getattr(cells[key][router], field) / max(1e-9, best))
            grid.append(row)
        image = ax.imshow(grid, cmap="RdYlGn_r", vmin=1.0, vmax=3.0, aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(routers)), routers, fontsize=8)
        ax.set_xticks(range(len(keys)), [k[0] for k in keys], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"TTFT {title} regret (router ÷ best router in the cell)")
        fig.colorbar(image, ax=ax, fraction=0.02)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "routing-regret.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
