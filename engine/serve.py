"""Wire an engine together from ``infergate engine serve`` options and run it."""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infergate.engine.sim_runner import TimingModel
from infergate.engine.tool_parsers import PARSERS

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
    kv_transfer_config: str | None = None  # vLLM's JSON form (engine/kv_transfer/config.py)
    kv_transfer_bandwidth_gbps: float | None = None
    completion_events_port: int | None = None  # ZMQ PUB of completion records (ours)
    # Load reports on the same socket (infergate/wire/load.py): sampling tick, heartbeat.
    load_report_tick: float = 0.01
    load_report_heartbeat: float = 0.5
    api_key: str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    timing: TimingModel = field(default_factory=TimingModel)
    sim_default_max_tokens: int = 256
    generation_config: str = "auto"  # auto | vllm | DIR
    chat_template: str | None = None  # a path or the template itself
    tokenizer: Path | None = None  # --tokenizer: a directory with tokenizer.json
    tensor_parallel_size: int = 1
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    dev_mode: bool = False  # --enable-dev-endpoints (or VLLM_SERVER_DEV_MODE=1)
    enable_lora: bool = False
    lora_modules: list[str] = field(default_factory=list)  # name=path or vLLM's JSON
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    sim_lora_load_ms: float = 25.0
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
    if opts.tool_call_parser is not None and opts.tool_call_parser not in PARSERS:
        raise ServeError(
            f"--tool-call-parser {opts.tool_call_parser}: unknown parser "
            f"(known: {', '.join(sorted(PARSERS))})"
        )
    if opts.enable_auto_tool_choice and opts.tool_call_parser is None:
        raise ServeError("--enable-auto-tool-choice requires --tool-call-parser to be set")


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
    import prometheus_client
    from infergate.engine.async_engine import AsyncEngine
    from infergate.engine.core import EngineCore
    from infergate.engine.entrypoints.api_server import build_app
    from infergate.engine.entrypoints.config import ServerConfig
    from infergate.engine.kv_events import (
        KVEventsConfig,
        ZmqEventPublisher,
        bind_endpoint,
        is_bind_endpoint,
    )
    from infergate.engine.metrics import EngineMetrics, SimulatorCollector
    from infergate.engine.scheduler import SchedulerConfig
    from infergate.engine.sim_runner import SimulatedRunner, default_num_blocks
    from infergate.engine.tokenizer import Tokenizer, TokenizerError

    check_vllm_flags(opts)
    lora_modules = _lora_modules(opts)
    model_dir = resolve_model(opts)
    if not model_dir.is_dir():
        raise ServeError(
            f"model directory {model_dir} does not exist; point MODEL_DIR at a local Hugging "
            f"Face model, or create a test model with `infergate engine make-tiny-model {model_dir}`"
        )
    cfg = _model_config(model_dir)
    tokenizer_dir = opts.tokenizer or model_dir
    try:
        tokenizer = Tokenizer(tokenizer_dir)
    except (TokenizerError, ValueError, OSError) as error:
        raise ServeError(f"cannot load the tokenizer from {tokenizer_dir}: {error}") from None
    if opts.chat_template is not None:
        tokenizer.chat_template = read_chat_template(opts.chat_template)
    defaults = generation_defaults(opts.generation_config, model_dir)
    if defaults:
        log.info("request defaults from generation_config.json: %s", defaults)
    names = opts.served_model_name or [str(opts.model_dir)]
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

    lora = _attach_lora(opts, runner, lora_modules)
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
    bind = None  # --kv-events-config's endpoint: vLLM's rule (a wildcard binds)
    if opts.kv_events_port is not None:  # on --host, like the HTTP server
        endpoint, bind = bind_endpoint(opts.host, opts.kv_events_port), True
    if endpoint is not None:
        try:
            events = ZmqEventPublisher(endpoint, topic=topic, hwm=hwm, bind=bind)
        except Exception as error:  # zmq.ZMQError: address in use, bad endpoint
            raise ServeError(f"cannot open KV events endpoint {endpoint}: {error}") from None
        verb = "bound to" if bind or is_bind_endpoint(endpoint) else "connected to"
        log.info("publishing KV events (%s) %s, topic %r", verb, endpoint, topic)
    core = EngineCore(
        runner,
        SchedulerConfig(
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_loras=opts.max_loras if lora is not None else 0,
        ),
        tokenizer=tokenizer,
        enable_prefix_caching=opts.enable_prefix_caching,
        metrics=metrics,
        kv_events=events,
        lora=lora,
    )
    engine = AsyncEngine(core)
    kv_transfer = _kv_transfer(opts, core, runner, metrics, names[0], engine)
    server_config = ServerConfig(
        served_model_names=names,
        model_dir=str(model_dir),
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        api_key=opts.api_key,
        default_max_tokens_cap=opts.sim_default_max_tokens if opts.simulate else None,
        supports_logprobs=not opts.simulate,
        structured_output=not opts.simulate,
        enable_auto_tool_choice=opts.enable_auto_tool_choice,
        tool_call_parser=opts.tool_call_parser,
        generation_defaults=defaults,
        dev_mode=opts.dev_mode or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
    )
    log.info(
        "engine ready to start: model=%s max_model_len=%d blocks=%d block_size=%d "
        "max_num_seqs=%d max_num_batched_tokens=%d",
        names[0], max_model_len, runner.num_blocks, runner.block_size,
        opts.max_num_seqs, opts.max_num_batched_tokens,
    )  # fmt: skip
    app = build_app(engine, tokenizer, server_config, metrics, kv_transfer=kv_transfer)
    if opts.completion_events_port is not None:
        from infergate.engine.completion_events import CompletionPublisher, CompletionReporter

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
    return app


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

        manager = attach_torch_lora(runner, max_loras=opts.max_loras,
                                    max_lora_rank=opts.max_lora_rank,
                                    max_cpu_loras=opts.max_cpu_loras).manager  # fmt: skip
    for module in modules:
        try:
            manager.add(module.name, module.path)
        except LoRAError as error:
            raise ServeError(f"--lora-modules {module.name}: {error}") from None
    manager.parents = {m.name: m.base_model_name for m in modules if m.base_model_name}
    log.info("LoRA: %d adapter(s) registered, %d slot(s), max rank %d", len(modules),
             opts.max_loras, opts.max_lora_rank)  # fmt: skip
    return manager


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
