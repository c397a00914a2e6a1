"""Wire an engine together from ``infergate engine serve`` options and run it."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infergate.engine.core.waiting_queue import POLICIES, SchedulingPolicy
from infergate.engine.sim_runner import TimingModel
from infergate.engine.tool_parsers import PARSERS

from infergate.options import argument, option, options_group

log = logging.getLogger("infergate.engine")


class ServeError(RuntimeError):
    """A start-up problem the user can fix; printed as one line."""


@dataclass
class ServeOptions:
    """``infergate engine serve``'s options: each field is one flag (infergate.options).

    Adding a flag is adding a field here with :func:`option`; ``engine/cli.py`` generates
    the command from these fields, and ``vllm_args`` reads the flags from that command.
    """

    model_dir: Path = argument(
        metavar="MODEL_DIR",
        help="A local Hugging Face model directory, a .gguf file (or a directory holding "
        "one), or the name of a fetched model (smollm2).",
    )
    host: str = option("--host", default="127.0.0.1", help="Address to listen on.")
    port: int = option("--port", default=8000, help="HTTP port.")
    served_model_name: list[str] = option(
        "--served-model-name",
        default_factory=list,
        several=True,
        help="Name(s) clients use, several after one flag (vLLM's form); default: MODEL_DIR.",
    )
    block_size: int = option("--block-size", default=16, min=1, help="Tokens per KV block.")
    max_num_seqs: int = option(
        "--max-num-seqs", default=256, min=1, help="Sequences in one batch at most."
    )
    max_num_batched_tokens: int = option(
        "--max-num-batched-tokens", default=2048, min=1, help="Tokens in one step at most."
    )
    max_model_len: int | None = option(
        "--max-model-len", default=None, help="Context length; default: the model's."
    )
    gpu_memory_utilization: float = option(
        "--gpu-memory-utilization",
        default=0.9,
        help="Share of the device's memory for weights and KV cache.",
    )
    load_format: str = option(
        "--load-format", default="auto", help="auto, safetensors, gguf or dummy."
    )
    dtype: str = option(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's on CUDA, float32 on CPU), float32, float16 or bfloat16.",
    )
    quantization: str = option(
        "--quantization",
        default="auto",
        help="gguf: keep a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights quantized (CPU int4 "
        "kernel); none: dequantize them to --dtype; auto: gguf for a GGUF on CPU, else none.",
    )
    device: str = option("--device", default="auto", help="auto, cpu or cuda.")
    simulate: bool = option(
        "--simulate",
        default=False,
        help="Timing model instead of a forward pass (no GPU needed).",
    )
    kv_events_port: int | None = option(
        "--kv-events-port",
        default=None,
        help="Publish KV events (vLLM's format) on this ZMQ PUB port.",
    )
    kv_events_replay_port: int | None = option(
        "--kv-events-replay-port",
        default=None,
        help="Serve vLLM's KV events replay socket (ZMQ ROUTER) on this port.",
    )
    kv_events_config: str | None = option(
        "--kv-events-config",
        default=None,
        help="vLLM's KV events JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://epp:5557", "topic": "kv@pod@model"}\' '
        "(a concrete host connects, a * binds).",
    )
    kv_transfer_config: str | None = option(
        "--kv-transfer-config",
        default=None,
        help="vLLM's KV transfer JSON for prefill/decode disaggregation, e.g. "
        '\'{"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": 14579}\' '
        "(engine/kv_transfer/config.py).",
    )
    kv_transfer_bandwidth_gbps: float | None = option(
        "--kv-transfer-bandwidth-gbps",
        default=None,
        min=0,
        help="Model a KV transfer link of this bandwidth (a pull lasts at least "
        "bytes x 8 / bandwidth); how simulated mode prices a transfer.",
    )
    completion_events_port: int | None = option(
        "--completion-events-port",
        default=None,
        help="Publish one completion record per EPP-routed request (ZMQ PUB on this port; "
        "the Endpoint Picker's response accounting without response bodies), and load "
        "reports on change, so the Endpoint Picker need not scrape /metrics.",
    )
    load_report_heartbeat: float = option(
        "--load-report-heartbeat",
        default=0.5,
        min=0.01,
        help="Seconds between load reports when nothing changes (keep it well under the "
        "EPP's --metrics-staleness-threshold).",
    )
    #: How often the load reporter samples the engine's state (not a flag).
    load_report_tick: float = 0.01
    api_key: str | None = option(
        "--api-key",
        default=None,
        envvar="INFERGATE_API_KEY",
        help="Require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and "
        "/reset_prefix_cache (/health, /metrics and /version stay open); a decode engine "
        "also sends it to its prefill engine.",
    )
    num_gpu_blocks_override: int | None = option(
        "--num-gpu-blocks-override", default=None, min=1, help="KV cache size in blocks."
    )
    kv_cache_memory_bytes: int | None = option(
        "--kv-cache-memory-bytes",
        default=None,
        min=1,
        help="KV cache size in bytes (vLLM's flag); default on CUDA: what "
        "--gpu-memory-utilization leaves, on CPU: 128 MiB, at least one --max-model-len "
        "sequence. --num-gpu-blocks-override wins over it.",
    )
    kv_cache_dtype: str = option(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype; bfloat16 for a float32 model on CPU), bfloat16 or float32.",
    )
    enable_prefix_caching: bool = option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        default=True,
        help="Reuse the KV of a cached prompt prefix.",
    )
    scheduling_policy: str = option(
        "--scheduling-policy",
        default="fcfs",
        help="fcfs (arrival order) or priority (the request's priority field, lower first; "
        "ties by arrival), as vLLM's flag.",
    )
    timing: TimingModel = options_group(TimingModel)
    """Simulated mode's step time (the ``--sim-*`` options)."""
    sim_default_max_tokens: int = option(
        "--sim-default-max-tokens",
        default=256,
        min=1,
        help="Simulated mode: output length when a request gives no max_tokens (no EOS).",
    )
    generation_config: str = option(
        "--generation-config",
        default="auto",
        help="Request defaults: auto (MODEL_DIR's generation_config.json), vllm (none), "
        "or a directory holding a generation_config.json.",
    )
    chat_template: str | None = option(
        "--chat-template",
        default=None,
        help="A Jinja chat template: a file path or the template.",
    )
    tokenizer: Path | None = option(
        "--tokenizer",
        default=None,
        help="A directory with tokenizer.json (and tokenizer_config.json) to use instead of "
        "MODEL_DIR's, or of the one a GGUF carries.",
    )
    tensor_parallel_size: int = option(
        "--tensor-parallel-size",
        "-tp",
        default=1,
        min=1,
        help="Only 1 (one device) is supported.",
    )
    trust_remote_code: bool = option(
        "--trust-remote-code",
        default=False,
        help="Accepted for vLLM parity; no remote code is run.",
    )
    disable_log_requests: bool = option(
        "--disable-log-requests",
        default=False,
        help="Accepted for vLLM parity (requests are not logged).",
    )
    enable_auto_tool_choice: bool = option(
        "--enable-auto-tool-choice",
        default=False,
        help="Let the model choose to call tools (tool_choice auto); needs --tool-call-parser.",
    )
    tool_call_parser: str | None = option(
        "--tool-call-parser",
        default=None,
        help="How tool calls appear in the model's text: hermes (Hermes/Qwen) or llama3_json.",
    )
    dev_mode: bool = option(
        "--enable-dev-endpoints",
        default=False,
        help="Development routes (/reset_prefix_cache), as vLLM's VLLM_SERVER_DEV_MODE=1.",
    )
    enable_lora: bool = option("--enable-lora", default=False, help="Serve LoRA adapters.")
    lora_modules: list[str] = option(
        "--lora-modules",
        default_factory=list,
        several=True,
        help='Adapters to serve: name=path, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; repeatable, or several after one flag.',
    )
    max_loras: int = option("--max-loras", default=1, help="Adapters resident in one batch.")
    max_lora_rank: int = option("--max-lora-rank", default=16, help="Highest adapter rank.")
    max_cpu_loras: int | None = option(
        "--max-cpu-loras",
        default=None,
        help="Adapters kept loaded in CPU memory (default: --max-loras).",
    )
    sim_lora_load_ms: float = option(
        "--sim-lora-load-ms",
        default=25.0,
        help="Simulated time to load an adapter into a slot (ms).",
    )
    enable_responses_api_store: bool = option(
        "--enable-responses-api-store/--no-enable-responses-api-store",
        default=True,
        help="Keep /v1/responses responses in memory for previous_response_id, GET and "
        "cancel (vLLM's VLLM_ENABLE_RESPONSES_API_STORE, here on by default and bounded).",
    )
    responses_api_store_max_entries: int = option(
        "--responses-api-store-max-entries",
        default=1024,
        min=1,
        help="Most responses the store holds; the oldest goes first.",
    )
    responses_api_store_ttl: float = option(
        "--responses-api-store-ttl",
        default=3600.0,
        min=1,
        help="Seconds a stored response is kept after its last update.",
    )
    log_level: str = option("--log-level", default="info", help="debug, info, warning or error.")


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(setting: str, model_dir: Path) -> dict[str, float]:
    """vLLM's ``--generation-config``: sampling defaults from generation_config.json."""
    if setting == "vllm":
        return {}
    path = (model_dir if setting == "auto" else Path(setting)) / "generation_config.json"
    if not path.exists():
        if setting != "auto":
            raise ServeError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ServeError(f"cannot read {path}: {error}") from None
    out = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def check_vllm_flags(opts: ServeOptions) -> None:
    """vLLM flags accepted but not (yet) meaningful here: a clear refusal, not a no-op."""
    if opts.tensor_parallel_size != 1:
        raise ServeError(
            f"--tensor-parallel-size {opts.tensor_parallel_size}: tensor parallelism is not "
            "supported; the engine runs on one device (use 1)"
        )
    if opts.tool_call_parser is not None and opts.tool_call_parser not in PARSERS:
        raise ServeError(
            f"--tool-call-parser {opts.tool_call_parser}: unknown parser "
            f"(known: {', '.join(sorted(PARSERS))})"
        )
    if opts.enable_auto_tool_choice and opts.tool_call_parser is None:
        raise ServeError("--enable-auto-tool-choice requires --tool-call-parser to be set")
    _policy(opts.scheduling_policy)
    from infergate.engine.weights import KV_CACHE_DTYPES

    if opts.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ServeError(
            f"--kv-cache-dtype {opts.kv_cache_dtype}: choose one of {', '.join(KV_CACHE_DTYPES)} "
            "(fp8 caches are not supported)"
        )


def _policy(value: str) -> SchedulingPolicy:
    """--scheduling-policy, checked (vLLM's two values)."""
    for policy in POLICIES:
        if value == policy:
            return policy
    raise ServeError(f"--scheduling-policy {value}: choose one of {', '.join(POLICIES)}")


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the argument itself when it is no file."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if "{" not in value:
        raise ServeError(f"--chat-template {value}: no such file, and not a Jinja template")
    return value


def _model_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.exists():
        raise ServeError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ServeError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ServeError(f"{path} is not a JSON object")
    return data


def resolve_model(opts: ServeOptions) -> Path:
    """The directory to load for MODEL_DIR: itself, or for a GGUF (a .gguf file, a directory
    holding one, or the name of a model `infergate engine fetch-model` fetched) the Hugging
    Face-style directory derived from it (see gguf_model)."""
    from infergate.engine.fetch import MODELS, cache_dir, fetched_model

    path = opts.model_dir
    if not path.exists() and str(path) in MODELS:
        fetched = fetched_model(str(path))
        if fetched is None:
            raise ServeError(
                f"model {path} has not been fetched; run `infergate engine fetch-model {path}`"
            )
        path = fetched
    if not (path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")))):
        return path
    from infergate.engine.gguf_model import GGUFError, find_gguf, prepare_model_dir

    try:
        gguf = find_gguf(path)
        if gguf is None:
            return path
        log.info("serving GGUF %s", gguf)
        return prepare_model_dir(gguf, cache_dir(), tokenizer=opts.tokenizer is None)
    except (GGUFError, OSError) as error:
        raise ServeError(f"cannot serve {path}: {error}") from None


def filler_token_ids(tokenizer: Any) -> list[int]:
    """Ordinary tokens that read as plain text on their own: the simulator's output."""
    skip = tokenizer.special_token_ids | tokenizer.eos_token_ids
    out = []
    for token_id in range(tokenizer.vocab_size):
        if token_id in skip:
            continue
        text = tokenizer.decode([token_id])
        if text.strip() and text.isascii() and text.isprintable():
            out.append(token_id)
    return out or [t for t in range(tokenizer.vocab_size) if t not in skip]


def build(opts: ServeOptions) -> Any:
    """Load tokenizer and runner, build core + async engine + FastAPI app; return the app."""
    from infergate.engine.async_engine import AsyncEngine
    from infergate.engine.core.engine_core import EngineCore
    from infergate.engine.core.scheduler import SchedulerConfig
    from infergate.engine.entrypoints.api_server import build_app
    from infergate.engine.entrypoints.config import ServerConfig

    check_vllm_flags(opts)
    lora_modules = _lora_modules(opts)
    model_dir = resolve_model(opts)
    if not model_dir.is_dir():
        raise ServeError(
            f"model directory {model_dir} does not exist; point MODEL_DIR at a local Hugging "
            f"Face model, or create a test model with `infergate engine make-tiny-model {model_dir}`"
        )
    cfg = _model_config(model_dir)
    tokenizer = _load_tokenizer(opts, model_dir)
    defaults = generation_defaults(opts.generation_config, model_dir)
    if defaults:
        log.info("request defaults from generation_config.json: %s", defaults)
    names = opts.served_model_name or [str(opts.model_dir)]
    config_len = int(cfg.get("max_position_embeddings") or 2048)
    # A simulated engine runs no forward pass: the model is only a tokenizer, and its
    # position limit does not bind (a replayed trace sets the context it needs).
    if opts.max_model_len is not None and opts.max_model_len > config_len and not opts.simulate:
        raise ServeError(
            f"--max-model-len {opts.max_model_len} exceeds the model's "
            f"max_position_embeddings ({config_len})"
        )
    runner, max_model_len = _runner(opts, model_dir, tokenizer, config_len)
    lora = _attach_lora(opts, runner, lora_modules)
    max_model_len = _fit_in_kv_cache(opts, runner, max_model_len)

    metrics = _engine_metrics(opts, names[0], runner, max_model_len)
    core = EngineCore(
        runner,
        SchedulerConfig(
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_loras=opts.max_loras if lora is not None else 0,
            policy=_policy(opts.scheduling_policy),
        ),
        tokenizer=tokenizer,
        enable_prefix_caching=opts.enable_prefix_caching,
        metrics=metrics,
        kv_events=_kv_events_publisher(opts),
        lora=lora,
    )
    engine = AsyncEngine(core)
    kv_transfer = _kv_transfer(opts, core, runner, metrics, names[0], engine)
    server_config = ServerConfig(
        served_model_names=names,
        model_dir=str(model_dir),
        max_model_len=max_model_len,
        vocab_size=max(int(cfg.get("vocab_size") or 0), tokenizer.vocab_size),
        api_key=opts.api_key,
        default_max_tokens_cap=opts.sim_default_max_tokens if opts.simulate else None,
        supports_logprobs=not opts.simulate,
        structured_output=not opts.simulate,
        enable_auto_tool_choice=opts.enable_auto_tool_choice,
        tool_call_parser=opts.tool_call_parser,
        generation_defaults=defaults,
        dev_mode=opts.dev_mode or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        scheduling_policy=opts.scheduling_policy,
        responses_store=opts.enable_responses_api_store,
        responses_store_max_entries=opts.responses_api_store_max_entries,
        responses_store_ttl_s=opts.responses_api_store_ttl,
    )
    log.info(
        "engine ready to start: model=%s max_model_len=%d blocks=%d block_size=%d "
        "max_num_seqs=%d max_num_batched_tokens=%d",
        names[0], max_model_len, runner.num_blocks, runner.block_size,
        opts.max_num_seqs, opts.max_num_batched_tokens,
    )  # fmt: skip
    app = build_app(engine, tokenizer, server_config, metrics, kv_transfer=kv_transfer)
    _report_completions(opts, app, metrics)
    return app


def _engine_metrics(opts: ServeOptions, model_name: str, runner: Any, max_model_len: int) -> Any:
    """vLLM's Prometheus series (plus the simulator's own in simulated mode)."""
    import prometheus_client
    from infergate.engine.metrics import EngineMetrics, SimulatorCollector

    # The EPP scrapes every 50 ms: leave out the *_created series, as vLLM does.
    prometheus_client.disable_created_metrics()
    metrics = EngineMetrics(
        model_name, block_size=runner.block_size, num_gpu_blocks=runner.num_blocks,
        max_model_len=max_model_len,
    )  # fmt: skip
    if opts.simulate:
        metrics.registry.register(SimulatorCollector(runner))
    return metrics


def _load_tokenizer(opts: ServeOptions, model_dir: Path) -> Any:
    """``--tokenizer`` (else MODEL_DIR's), with ``--chat-template`` applied."""
    from infergate.engine.tokenizer import Tokenizer, TokenizerError

    tokenizer_dir = opts.tokenizer or model_dir
    try:
        tokenizer = Tokenizer(tokenizer_dir)
    except (TokenizerError, ValueError, OSError) as error:
        raise ServeError(f"cannot load the tokenizer from {tokenizer_dir}: {error}") from None
    if opts.chat_template is not None:
        tokenizer.chat_template = read_chat_template(opts.chat_template)
    return tokenizer


def _runner(
    opts: ServeOptions, model_dir: Path, tokenizer: Any, config_len: int
) -> tuple[Any, int]:
    """The model runner (simulated, or torch on ``--device``) and its max_model_len."""
    if opts.simulate:
        from infergate.engine.sim_runner import SimulatedRunner

        num_blocks = opts.num_gpu_blocks_override or opts.timing.num_blocks(
            opts.block_size, opts.gpu_memory_utilization
        )
        runner = SimulatedRunner(
            block_size=opts.block_size,
            num_blocks=num_blocks,
            filler_token_ids=filler_token_ids(tokenizer),
            timing=opts.timing,
        )
        log.info("simulated mode: %s, %d KV blocks of %d tokens", opts.timing, num_blocks,
                 opts.block_size)  # fmt: skip
        return runner, opts.max_model_len or config_len
    try:
        from infergate.engine.model_runner import TorchModelRunner
    except ImportError as error:
        raise ServeError(f"the model runner is not available: {error}") from None
    log.info("loading %s (device=%s, dtype=%s, load_format=%s, quantization=%s)", model_dir,
             opts.device, opts.dtype, opts.load_format, opts.quantization)  # fmt: skip
    try:
        torch_runner = TorchModelRunner.from_model_dir(
            model_dir,
            block_size=opts.block_size,
            num_blocks=opts.num_gpu_blocks_override,
            dtype=opts.dtype,
            device=opts.device,
            load_format=opts.load_format,
            quantization=opts.quantization,
            kv_cache_dtype=opts.kv_cache_dtype,
            kv_cache_memory_bytes=opts.kv_cache_memory_bytes,
            max_model_len=opts.max_model_len,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            gpu_memory_utilization=opts.gpu_memory_utilization,
        )
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        raise ServeError(f"cannot load {model_dir}: {error}") from None
    tokenizer.eos_token_ids = tokenizer.eos_token_ids | frozenset(torch_runner.eos_token_ids)
    return torch_runner, int(torch_runner.max_model_len)


def _fit_in_kv_cache(opts: ServeOptions, runner: Any, max_model_len: int) -> int:
    """max_model_len, lowered to the KV cache's capacity unless ``--max-model-len`` asked
    for more (then a clear refusal)."""
    capacity = runner.num_blocks * runner.block_size
    if max_model_len <= capacity:
        return max_model_len
    if opts.max_model_len is not None:
        raise ServeError(
            f"--max-model-len {max_model_len} does not fit in the KV cache "
            f"({runner.num_blocks} blocks x {runner.block_size} = {capacity} tokens)"
        )
    log.warning("max_model_len lowered from %d to the KV capacity %d", max_model_len, capacity)
    return capacity


def _kv_events_publisher(opts: ServeOptions) -> Any:
    """The KV events publisher the options ask for (with its replay socket), or None.

    ``--kv-events-port`` / ``--kv-events-replay-port`` bind on ``--host`` and win over the
    endpoints of ``--kv-events-config``, whose other fields (topic, hwm, buffer_steps)
    count whenever the JSON is given.
    """
    from infergate.engine.kv_events import (
        KVEventsConfig,
        ZmqEventPublisher,
        bind_endpoint,
        is_bind_endpoint,
    )

    config = KVEventsConfig()
    if opts.kv_events_config is not None:
        try:
            config = KVEventsConfig.parse(opts.kv_events_config)
        except ValueError as error:
            raise ServeError(str(error)) from None
    endpoint = config.endpoint if config.active else None
    bind = None  # --kv-events-config's endpoint: vLLM's rule (a wildcard binds)
    if opts.kv_events_port is not None:  # on --host, like the HTTP server
        endpoint, bind = bind_endpoint(opts.host, opts.kv_events_port), True
    replay = config.replay_endpoint
    if opts.kv_events_replay_port is not None:
        replay = bind_endpoint(opts.host, opts.kv_events_replay_port)
    if endpoint is None:
        if replay is not None:
            log.warning("KV events replay needs a publisher (--kv-events-port); not served")
        return None
    try:
        events = ZmqEventPublisher(
            endpoint, topic=config.topic, hwm=config.hwm, bind=bind,
            replay_endpoint=replay, buffer_steps=config.buffer_steps,
        )  # fmt: skip
    except Exception as error:  # zmq.ZMQError: address in use, bad endpoint
        where = endpoint if replay is None else f"{endpoint} (replay {replay})"
        raise ServeError(f"cannot open KV events endpoint {where}: {error}") from None
    verb = "bound to" if bind or is_bind_endpoint(endpoint) else "connected to"
    log.info("publishing KV events (%s) %s, topic %r", verb, endpoint, config.topic)
    if replay is not None:
        log.info("KV events replay on %s (last %d batches)", replay, config.buffer_steps)
    return events


def _report_completions(opts: ServeOptions, app: Any, metrics: Any) -> None:
    """``--completion-events-port``: one completion record per EPP-routed request, and load
    reports (infergate/wire/load.py) on change plus a heartbeat, on the same socket."""
    if opts.completion_events_port is None:
        return
    from infergate.engine.completion_events import CompletionPublisher, CompletionReporter
    from infergate.engine.kv_events import bind_endpoint

    endpoint = bind_endpoint(opts.host, opts.completion_events_port)  # on --host
    try:
        publisher = CompletionPublisher(endpoint)
    except Exception as error:  # zmq.ZMQError: address in use
        raise ServeError(f"cannot open completion events endpoint {endpoint}: {error}") from None
    app.add_middleware(CompletionReporter, publisher=publisher)
    from infergate.engine.load_reports import LoadReporter

    try:
        reporter = LoadReporter(
            metrics.load_state,
            publisher.publish_load,
            tick=opts.load_report_tick,
            heartbeat=opts.load_report_heartbeat,
        )
    except ValueError as error:
        raise ServeError(str(error)) from None
    reporter.start()
    log.info("publishing completion records and load reports on %s", endpoint)


def _kv_transfer(
    opts: ServeOptions, core: Any, runner: Any, metrics: Any, model_name: str, engine: Any
) -> Any:
    """``--kv-transfer-config``: P/D state in the core, the connector, its metrics."""
    if opts.kv_transfer_config is None:
        if opts.kv_transfer_bandwidth_gbps is not None:
            raise ServeError("--kv-transfer-bandwidth-gbps needs --kv-transfer-config")
        return None
    from infergate.engine.kv_transfer.blocks import KVTransfer
    from infergate.engine.kv_transfer.config import KVTransferConfig
    from infergate.engine.kv_transfer.service import KVTransferCollector, KVTransferService
    from infergate.engine.kv_transfer.zmq_connector import ZmqConnector
    from infergate.engine.sim_runner import SIMULATED_MODEL_CONFIG, kv_bytes_per_token

    try:
        config = KVTransferConfig.parse(opts.kv_transfer_config)
    except ValueError as error:
        raise ServeError(str(error)) from None
    extra = config.kv_connector_extra_config
    if opts.kv_transfer_bandwidth_gbps is not None:
        extra.link_bandwidth_gbps = opts.kv_transfer_bandwidth_gbps
    if config.is_consumer and not opts.enable_prefix_caching:
        raise ServeError(
            "--kv-transfer-config: a kv_consumer/kv_both engine needs prefix caching (pulled "
            "KV is committed as prefix-cache blocks); drop --no-enable-prefix-caching"
        )
    # Simulated mode has no tensors: a transfer stands for the modelled model's KV bytes.
    modelled = kv_bytes_per_token(SIMULATED_MODEL_CONFIG) * runner.block_size
    core.kv_transfer = KVTransfer(
        core.kv,
        runner,
        engine_id=config.engine_id or uuid.uuid4().hex,
        abort_timeout_s=extra.abort_timeout_s,
        modelled_block_bytes=modelled if opts.simulate else 0,
    )
    service = KVTransferService(
        config, core.kv_transfer, ZmqConnector(config), api_key=opts.api_key
    )
    try:
        service.start(engine)
    except Exception as error:  # zmq.ZMQError: the port is taken, a bad address
        raise ServeError(
            f"--kv-transfer-config: cannot listen on {config.kv_ip}:{config.kv_port}: {error}"
        ) from None
    metrics.registry.register(KVTransferCollector(service, model_name))
    log.info("KV transfer: %s as %s", config.kv_connector, config.kv_role)
    return service


def _lora_modules(opts: ServeOptions) -> list[Any]:
    """Check the LoRA flags (vLLM's rules) and parse ``--lora-modules``."""
    from infergate.engine.lora.options import parse_lora_modules

    if not opts.enable_lora:
        if opts.lora_modules:
            raise ServeError("--lora-modules needs --enable-lora")
        return []
    if opts.max_loras < 1 or opts.max_lora_rank < 1:
        raise ServeError("--max-loras and --max-lora-rank must be at least 1")
    if opts.max_cpu_loras is not None and opts.max_cpu_loras < opts.max_loras:
        raise ServeError(
            f"--max-cpu-loras ({opts.max_cpu_loras}) must be at least --max-loras "
            f"({opts.max_loras})"
        )
    try:
        return parse_lora_modules(opts.lora_modules)
    except ValueError as error:
        raise ServeError(str(error)) from None


def _attach_lora(opts: ServeOptions, runner: Any, modules: list[Any]) -> Any:
    """The runner's LoRAManager with ``--lora-modules`` registered (None without LoRA).

    Simulated mode serves adapters by name: paths are recorded, never read, and bringing
    an adapter into a slot costs ``--sim-lora-load-ms`` of step time.
    """
    if not opts.enable_lora:
        return None
    from infergate.engine.lora.errors import LoRAError
    from infergate.engine.lora.manager import LoRAManager

    if opts.simulate:
        manager = LoRAManager(max_loras=opts.max_loras, max_lora_rank=opts.max_lora_rank,
                              max_cpu_loras=opts.max_cpu_loras)  # fmt: skip
        runner.lora, runner.lora_load_seconds = manager, opts.sim_lora_load_ms / 1000
    else:
        from infergate.engine.lora.runner import attach_torch_lora

        try:
            manager = attach_torch_lora(runner, max_loras=opts.max_loras,
                                        max_lora_rank=opts.max_lora_rank,
                                        max_cpu_loras=opts.max_cpu_loras).manager  # fmt: skip
        except ValueError as error:  # e.g. projections kept quantized
            raise ServeError(f"--enable-lora: {error}") from None
    for module in modules:
        try:
            manager.add(module.name, module.path)
        except LoRAError as error:
            raise ServeError(f"--lora-modules {module.name}: {error}") from None
    manager.parents = {m.name: m.base_model_name for m in modules if m.base_model_name}
    log.info("LoRA: %d adapter(s) registered, %d slot(s), max rank %d", len(modules),
             opts.max_loras, opts.max_lora_rank)  # fmt: skip
    return manager


def freeze_startup_heap() -> None:
    """Move every object alive at start-up (the model's modules, the tokenizer, imported
    modules: ~220,000 on SmolLM2) out of the garbage collector's reach (``gc.freeze``,
    as vLLM does once the model is loaded). Here, in the server process, not in the app's
    lifespan: a test process that builds many apps would freeze each one's garbage for
    good.

    Why: a decode step allocates a few hundred tensors, so generation-0 collections run
    every few steps and older generations now and then; a full collection traversed
    every start-up object and stalled a step for tens of milliseconds. Frozen objects are
    still freed by reference counting; only what requests create is collected.
    """
    gc.collect()
    gc.freeze()


def serve(opts: ServeOptions) -> None:
    logging.basicConfig(
        level=opts.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn

    app = build(opts)
    freeze_startup_heap()
    log.info("serving on http://%s:%d (OpenAI API under /v1)", opts.host, opts.port)
    uvicorn.run(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
