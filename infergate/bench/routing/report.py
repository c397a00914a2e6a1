"""The lab's output: a terminal table, a JSON file, and plots (TTFT p90 and throughput vs
request rate, one line per router, one figure per workload)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
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
)


def row_cells(r: RunResult) -> list[str]:
    if r.skipped:
        return [r.workload, f"{r.rate:g}", r.router, "-", "-", f"skipped: {r.skipped}"] + [""] * 8
    lag = f"{r.sim_lag:.1%}" + (" !" if r.lag_warning else "")
    return [
        r.workload,
        f"{r.rate:g}",
        r.router,
        str(r.completed),
        str(r.failed),
        f"{r.ttft_p50_ms:.0f}",
        f"{r.ttft_p90_ms:.0f}",
        f"{r.ttft_p99_ms:.0f}",
        f"{r.e2e_p50_ms:.0f}",
        f"{r.e2e_p99_ms:.0f}",
        f"{r.output_tok_s:.0f}",
        f"{r.prefix_hit_rate:.0%}",
        f"{r.imbalance:.2f}",
        lag,
    ]


def table(results: Sequence[RunResult]) -> Table:
    t = Table(title="routing lab (times in ms)", show_lines=False)
    for _, title in COLUMNS:
        t.add_column(title, justify="left" if title in ("workload", "router") else "right")
    for r in results:
        t.add_row(*row_cells(r))
    return t


def markdown(results: Sequence[RunResult]) -> str:
    """The same table as GitHub markdown (for docs/benchmarks.md)."""
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---" if t in ("workload", "router") else "---:" for _, t in COLUMNS)
    lines = [head, rule + "|"]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in results]
    return "\n".join(lines)


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


def write_json(results: Sequence[RunResult], path: Path, meta: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))


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
