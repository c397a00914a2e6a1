"""``infergate bench``: serving benchmarks."""

from pathlib import Path

import typer

from infergate.unbuilt import not_built

app = typer.Typer(help="Benchmarks that print numbers (never timed tests).", no_args_is_help=True)


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
    num_prompts: int = typer.Option(100, "--num-prompts", help="How many requests to send."),
    max_concurrency: int | None = typer.Option(
        None, "--max-concurrency", help="Cap on requests in flight."
    ),
    result_file: Path | None = typer.Option(None, "--result-file", help="Write results as JSON."),
) -> None:
    """Load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E and throughput."""
    not_built("`infergate bench serve`", "issue 4 (Endpoint Picker)")
