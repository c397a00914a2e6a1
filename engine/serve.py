"""Wire an engine together from ``infergate engine serve`` options and run it."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infergate.engine.sim_runner import TimingModel

log = logging.getLogger("infergate.engine")


class ServeError(RuntimeError):
    """A start-up problem the user can fix; printed as one line."""


@dataclass
class ServeOptions:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    simulate: bool = False
    kv_events_port: int | None = None
    kv_events_config: str | None = None  # vLLM's JSON form (endpoint, topic, …)
    completion_events_port: int | None = None  # ZMQ PUB of completion records (ours)
    api_key: str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    timing: TimingModel = field(default_factory=TimingModel)
    sim_default_max_tokens: int = 256
    generation_config: str = "auto"  # auto | vllm | DIR
    chat_template: str | None = None  # a path or the template itself
    tensor_parallel_size: int = 1
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    dev_mode: bool = False  # --enable-dev-endpoints (or VLLM_SERVER_DEV_MODE=1)
    log_level: str = "info"


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
    if opts.enable_auto_tool_choice or opts.tool_call_parser is not None:
        raise ServeError(
            "--enable-auto-tool-choice/--tool-call-parser: tool calling is not implemented yet"
        )


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
    import prometheus_client
    from infergate.engine.async_engine import AsyncEngine
    from infergate.engine.core import EngineCore
    from infergate.engine.entrypoints.api_server import build_app
    from infergate.engine.entrypoints.config import ServerConfig
    from infergate.engine.kv_events import KVEventsConfig, ZmqEventPublisher, is_bind_endpoint
    from infergate.engine.metrics import EngineMetrics, SimulatorCollector
    from infergate.engine.scheduler import SchedulerConfig
    from infergate.engine.sim_runner import SimulatedRunner, default_num_blocks
    from infergate.engine.tokenizer import Tokenizer, TokenizerError

    check_vllm_flags(opts)
    model_dir = opts.model_dir
    if not model_dir.is_dir():
        raise ServeError(
            f"model directory {model_dir} does not exist; point MODEL_DIR at a local Hugging "
            f"Face model, or create a test model with `infergate engine make-tiny-model {model_dir}`"
        )
    cfg = _model_config(model_dir)
    try:
        tokenizer = Tokenizer(model_dir)
    except (TokenizerError, ValueError, OSError) as error:
        raise ServeError(f"cannot load the tokenizer from {model_dir}: {error}") from None
    if opts.chat_template is not None:
        tokenizer.chat_template = read_chat_template(opts.chat_template)
    defaults = generation_defaults(opts.generation_config, model_dir)
    if defaults:
        log.info("request defaults from generation_config.json: %s", defaults)
    names = opts.served_model_name or [str(model_dir)]
    config_len = int(cfg.get("max_position_embeddings") or 2048)
    if opts.max_model_len is not None and opts.max_model_len > config_len:
        raise ServeError(
            f"--max-model-len {opts.max_model_len} exceeds the model's "
            f"max_position_embeddings ({config_len})"
        )
    vocab_size = max(int(cfg.get("vocab_size") or 0), tokenizer.vocab_size)

    runner: Any
    if opts.simulate:
        num_blocks = opts.num_gpu_blocks_override or default_num_blocks(
            opts.block_size, opts.gpu_memory_utilization
        )
        filler = filler_token_ids(tokenizer)
        runner = SimulatedRunner(
            block_size=opts.block_size,
            num_blocks=num_blocks,
            filler_token_ids=filler,
            timing=opts.timing,
        )
        max_model_len = opts.max_model_len or config_len
        log.info("simulated mode: %s, %d KV blocks of %d tokens", opts.timing, num_blocks,
                 opts.block_size)  # fmt: skip
    else:
        try:
            from infergate.engine.model_runner import TorchModelRunner
        except ImportError as error:
            raise ServeError(f"the model runner is not available: {error}") from None
        log.info("loading %s (device=%s, dtype=%s, load_format=%s)", model_dir, opts.device,
                 opts.dtype, opts.load_format)  # fmt: skip
        try:
            runner = TorchModelRunner.from_model_dir(
                model_dir,
                block_size=opts.block_size,
                num_blocks=opts.num_gpu_blocks_override,
                dtype=opts.dtype,
                device=opts.device,
                load_format=opts.load_format,
                max_model_len=opts.max_model_len,
                max_num_batched_tokens=opts.max_num_batched_tokens,
                gpu_memory_utilization=opts.gpu_memory_utilization,
            )
        except (ValueError, KeyError, OSError, RuntimeError) as error:
            raise ServeError(f"cannot load {model_dir}: {error}") from None
        max_model_len = int(runner.max_model_len)
        tokenizer.eos_token_ids = tokenizer.eos_token_ids | frozenset(runner.eos_token_ids)

    capacity = runner.num_blocks * runner.block_size
    if max_model_len > capacity:
        if opts.max_model_len is not None:
            raise ServeError(
                f"--max-model-len {max_model_len} does not fit in the KV cache "
                f"({runner.num_blocks} blocks x {runner.block_size} = {capacity} tokens)"
            )
        log.warning("max_model_len lowered from %d to the KV capacity %d", max_model_len,
                    capacity)  # fmt: skip
        max_model_len = capacity

    # The EPP scrapes every 50 ms: leave out the *_created series, as vLLM does.
    prometheus_client.disable_created_metrics()
    metrics = EngineMetrics(
        names[0], block_size=runner.block_size, num_gpu_blocks=runner.num_blocks,
        max_model_len=max_model_len,
    )  # fmt: skip
    if opts.simulate:
        metrics.registry.register(SimulatorCollector(runner))
    events = None
    endpoint, topic, hwm = None, "", 100_000
    if opts.kv_events_config is not None:
        try:
            kv_config = KVEventsConfig.parse(opts.kv_events_config)
        except ValueError as error:
            raise ServeError(str(error)) from None
        if kv_config.active:
            endpoint, topic, hwm = kv_config.endpoint, kv_config.topic, kv_config.hwm
        if kv_config.replay_endpoint is not None:
            log.warning("KV events replay_endpoint is not supported; ignored")
    if opts.kv_events_port is not None:
        endpoint = f"tcp://*:{opts.kv_events_port}"
    if endpoint is not None:
        try:
            events = ZmqEventPublisher(endpoint, topic=topic, hwm=hwm)
        except Exception as error:  # zmq.ZMQError: address in use, bad endpoint
            raise ServeError(f"cannot open KV events endpoint {endpoint}: {error}") from None
        verb = "bound to" if is_bind_endpoint(endpoint) else "connected to"
        log.info("publishing KV events (%s) %s, topic %r", verb, endpoint, topic)
    core = EngineCore(
        runner,
        SchedulerConfig(
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        tokenizer=tokenizer,
        enable_prefix_caching=opts.enable_prefix_caching,
        metrics=metrics,
        kv_events=events,
    )
    server_config = ServerConfig(
        served_model_names=names,
        model_dir=str(model_dir),
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        api_key=opts.api_key,
        default_max_tokens_cap=opts.sim_default_max_tokens if opts.simulate else None,
        supports_logprobs=not opts.simulate,
        generation_defaults=defaults,
        dev_mode=opts.dev_mode or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
    )
    log.info(
        "engine ready to start: model=%s max_model_len=%d blocks=%d block_size=%d "
        "max_num_seqs=%d max_num_batched_tokens=%d",
        names[0], max_model_len, runner.num_blocks, runner.block_size,
        opts.max_num_seqs, opts.max_num_batched_tokens,
    )  # fmt: skip
    app = build_app(AsyncEngine(core), tokenizer, server_config, metrics)
    if opts.completion_events_port is not None:
        from infergate.engine.completion_events import CompletionPublisher, CompletionReporter

        endpoint = f"tcp://*:{opts.completion_events_port}"
        try:
            publisher = CompletionPublisher(endpoint)
        except Exception as error:  # zmq.ZMQError: address in use
            raise ServeError(f"cannot open completion events endpoint {endpoint}: {error}") from None
        app.add_middleware(CompletionReporter, publisher=publisher)
        log.info("publishing completion records on %s", endpoint)
    return app


def serve(opts: ServeOptions) -> None:
    logging.basicConfig(
        level=opts.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn

    app = build(opts)
    log.info("serving on http://%s:%d (OpenAI API under /v1)", opts.host, opts.port)
    uvicorn.run(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
