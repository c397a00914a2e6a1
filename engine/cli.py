"""``infergate engine``: serve a model, or make a tiny one for tests."""

from pathlib import Path

import typer

from infergate.unbuilt import not_built

app = typer.Typer(help="The vLLM-compatible inference engine.", no_args_is_help=True)


@app.command("serve")
def serve(
    model_dir: Path = typer.Argument(..., help="Local Hugging Face model directory."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    served_model_name: str | None = typer.Option(None, "--served-model-name"),
    block_size: int = typer.Option(16, "--block-size"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
    max_model_len: int | None = typer.Option(None, "--max-model-len"),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    load_format: str = typer.Option("auto", "--load-format", help="auto or dummy."),
    dtype: str = typer.Option("auto", "--dtype"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    simulate: bool = typer.Option(False, "--simulate"),
    kv_events_port: int | None = typer.Option(None, "--kv-events-port"),
    api_key: str | None = typer.Option(None, "--api-key"),
) -> None:
    """Serve MODEL_DIR with an OpenAI-compatible API, like `vllm serve`."""
    not_built("`infergate engine serve`", "issue 3 (Engine)")


@app.command("make-tiny-model")
def make_tiny_model(
    out_dir: Path = typer.Argument(..., help="Where to write the model."),
    arch: str = typer.Option("llama", "--arch", help="llama or qwen3."),
    seed: int = typer.Option(0, "--seed"),
    num_shards: int = typer.Option(
        1, "--num-shards", min=1, help="Split the weights over this many safetensors files."
    ),
) -> None:
    """Write a small random-weight model in Hugging Face format, for tests and demos."""
    from infergate.engine.tiny_model import ARCHS
    from infergate.engine.tiny_model import make_tiny_model as build

    if arch not in ARCHS:
        raise typer.BadParameter(f"choose one of {', '.join(ARCHS)}", param_hint="--arch")
    path = build(out_dir, arch=arch, seed=seed, num_shards=num_shards)
    typer.echo(f"wrote tiny {arch} model to {path}")
