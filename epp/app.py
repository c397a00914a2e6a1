"""Wires the EPP together and runs it until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from infergate.epp.config import ConfigError, load_config, parse_config
from infergate.epp.datalayer.collector import Collectors
from infergate.epp.datalayer.completions import CompletionSubscriptions
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.discovery.file import (
    EndpointsFileError,
    load_endpoints_file,
    watch_file,
)
from infergate.epp.datalayer.load_reports import LoadReports
from infergate.epp.datalayer.objectives import (
    ObjectivesError,
    ObjectiveStore,
    load_objectives_file,
)
from infergate.epp.flowcontrol import build_flow_controller
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.heap import freeze_heap, keep_freed_memory
from infergate.epp.native import load_native
from infergate.epp.observability import EppMetrics
from infergate.epp.options import EppOptions
from infergate.epp.requestcontrol.director import Director
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.scheduler import Scheduler
from infergate.epp.server.eds import EndpointDiscovery
from infergate.epp.server.extproc import ExtProcServer, Limits
from infergate.epp.server.health import HousekeepingHealth
from infergate.epp.server.record_sweep import RecordSweep
from infergate.epp.types import Endpoint

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from infergate.epp.server.h2 import H2Server

log = logging.getLogger("infergate.epp")

#: Readiness under every name a probe asks for: GIE's conformance manifests and chart probe
#: "inference-extension", llm-d's the ext-proc service, GIE's HA chart "readiness".
HEALTH_SERVICES = (
    "",
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
)
GRPC_SERVERS = ("aio", "h2")


class Epp:
    """The running Endpoint Picker. Construction validates everything; ``start`` binds."""

    def __init__(self, options: EppOptions) -> None:
        """Wire the EPP's parts from its options, in dependency order (long for a reason:
        the order the data layer, request control, scheduler and servers are built in is
        the order they depend on each other, read top to bottom)."""
        self.options = options
        if options.grpc_server not in GRPC_SERVERS:
            raise ConfigError(
                f"--grpc-server must be one of {', '.join(GRPC_SERVERS)}, not {options.grpc_server!r}"
            )
        config = options.config or (
            parse_config(options.config_text, "--config-text")
            if options.config_text
            else load_config(options.config_file)
        )
        sat = config.saturationDetector
        self.datastore = Datastore()
        # Envoy's pool cluster follows the same endpoint set over EDS (see eds.py).
        self.eds = EndpointDiscovery(self.datastore)
        self.saturation = SaturationDetector(
            sat.queueDepthThreshold,
            sat.kvCacheUtilThreshold,
            sat.metricsStalenessThreshold or options.metrics_staleness_threshold,
        )
        self.metrics = EppMetrics(self.datastore, self.saturation, options.pool_name or "local")
        self.objectives = ObjectiveStore(options.pool_name, options.client_priority_max)
        if options.objectives_file is not None:
            self.objectives.replace(*load_objectives_file(options.objectives_file))
        context = PluginContext(self.datastore, self.saturation, {"metrics": self.metrics})
        self.plugin_context = context
        self.scheduler = Scheduler.from_config(config, context, self.metrics.plugin_timer)
        self.flow = build_flow_controller(
            config.flowControl,
            self.datastore,
            self.saturation,
            self.metrics,
            options.pool_name or "local",
        )
        self.director = Director(
            self.datastore,
            self.scheduler,
            self.saturation,
            self.objectives,
            self.metrics,
            self.flow,
        )
        self.load_reports = LoadReports(self.datastore, self.metrics)
        self.completions = CompletionSubscriptions(
            self.datastore,
            lambda endpoint, record: self.ext_proc.on_record(endpoint, record),
            options.completion_events_port,
            on_removed=self._endpoint_removed,
            on_load=self.load_reports.on_payload,
        )
        self.ext_proc = ExtProcServer(
            self.director,
            Limits(
                max_body_bytes=options.max_request_body_bytes,
                max_buffered_bytes=options.max_buffered_bytes,
                max_streams=options.max_streams,
                body_timeout_s=options.body_timeout_s,
            ),
            options.scores_header,
            reports_completions=self.completions.reports,
            reports_all=self.completions.reports_all,
        )
        # Only this replica's records wake it (the engines publish them on its key's topic).
        self.completions.owner = self.ext_proc.key_prefix
        # What other replicas routed reaches this one's prefix index (admission records).
        prefix_index = context.extras.get("prefix_index")
        if prefix_index is not None:
            self.ext_proc.on_admitted = prefix_index.learn
            self.completions.on_admitted = prefix_index.learn
        if options.endpoints_file is not None:
            self.datastore.set_endpoints(load_endpoints_file(options.endpoints_file))
        elif options.static_endpoints:
            self.datastore.set_endpoints(options.static_endpoints)
        self.collectors = Collectors(
            self.datastore,
            options.refresh_metrics_interval,
            options.metrics_timeout,
            self.metrics,
            on_dead=self._endpoint_dead,
            staleness=self.saturation.staleness,
        )
        self._grpc: grpc.aio.Server | None = None
        self._h2: H2Server | None = None  # --grpc-server h2: the same on the event loop
        self.certificate: bytes | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health_h2: H2Server | None = None  # the health port, with --grpc-server h2
        #: Gives up lost completion records while requests are in flight.
        self.record_sweep = RecordSweep(
            lambda now: self.ext_proc.expire_records(now), self._in_flight
        )
        self.datastore.on_refresh(self.record_sweep.on_refresh)
        # Envoy's health checks also do the push watch's check when it is due.
        self._health = HousekeepingHealth(self.collectors.housekeep)
        self._metrics_http: WSGIServer | None = None
        self._stop = asyncio.Event()
        self._withdrawn = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._kube: Any = None
        self.grpc_port = options.grpc_port
        self.health_port = options.grpc_health_port
        self.metrics_port = options.metrics_port

    async def withdraw(self) -> None:
        """Answer NOT_SERVING to every health check from now on (readiness and liveness
        alike: a proxy health-checking the ext-proc port stops opening streams here) while
        still serving: the first step of a shutdown, before :meth:`stop`."""
        self._withdrawn = True
        for service in (*HEALTH_SERVICES, "liveness"):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _update_health(self) -> None:
        if self._withdrawn:
            return
        ready = len(self.datastore) > 0
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in HEALTH_SERVICES:
            await self._health.set(service, status)
        await self._health.set("liveness", health_pb2.HealthCheckResponse.SERVING)

    def _endpoint_removed(self, key: str) -> None:
        if self.datastore.get(key) is None:  # gone, not relabelled: its records will not come
            self.ext_proc.expire_records(asyncio.get_running_loop().time(), gone=key)
            self.load_reports.forget(key)

    def _endpoint_dead(self, key: str) -> None:
        """An endpoint known dead (the collector's verdict) sends no more completion
        records: give up waiting for them, which clears its in-flight count now."""
        self.ext_proc.expire_records(asyncio.get_running_loop().time(), gone=key)

    def _in_flight(self) -> bool:
        return bool(self.ext_proc.routed or self.ext_proc.awaiting)

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._update_health()))
        self._tasks = [t for t in self._tasks if not t.done()]

    def _grpc_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.keepalive_permit_without_calls", 1),
            # Off unless asked: a second EPP on a busy port must fail, not share it.
            ("grpc.so_reuseport", int(self.options.reuse_port)),
        ]

    def _ext_proc_server(self) -> grpc.aio.Server:
        """grpc.aio's server for the ext-proc port, with ext-proc, EDS and health on it."""
        self._grpc = grpc.aio.server(options=self._grpc_options())
        pb_grpc.add_ExternalProcessorServicer_to_server(self.ext_proc, self._grpc)
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.eds, self._grpc)
        # Health on the ext-proc port too, over its transport: Envoy's check then fails
        # when ext-proc would (TLS mismatch, not gRPC), not only when the port is closed.
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        return self._grpc

    def _h2_server(self, health_only: bool = False) -> H2Server:
        """ext-proc, EDS and health on the event loop's own HTTP/2 server (epp/server/h2.py);
        ``health_only``: health alone, for the health port."""
        from envoy.service.discovery.v3 import discovery_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2
        from infergate.epp.server.h2 import H2Server, Method

        health_request = health_pb2.HealthCheckRequest.FromString
        methods = {
            "/grpc.health.v1.Health/Check": Method("unary", self._health.Check, health_request),
            "/grpc.health.v1.Health/Watch": Method("unary", self._health.Watch, health_request),
        }
        if not health_only:
            methods["/envoy.service.ext_proc.v3.ExternalProcessor/Process"] = Method(
                "ext_proc",
                lambda: self.ext_proc,
                external_processor_pb2.ProcessingRequest.FromString,
            )
            methods["/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"] = Method(
                "stream", self.eds.StreamEndpoints, discovery_pb2.DiscoveryRequest.FromString
            )
        return H2Server(methods, max_message=64 << 20, max_streams=self.options.max_streams)

    async def _start_h2(self) -> None:
        o = self.options
        context = None
        if o.secure_serving:
            from infergate.epp.server.tls import server_ssl_context

            context, self.certificate = server_ssl_context(o.cert_path, o.client_ca_file)
        self._h2 = self._h2_server()
        try:
            self.grpc_port = await self._h2.start(o.host, o.grpc_port, context, o.reuse_port)
        except OSError as error:
            raise OSError(f"cannot bind gRPC port {o.grpc_port}: {error}") from None

    async def _start_h2_health(self) -> None:
        """The health port on the event loop too, with ext-proc on h2: a grpc.aio server
        for health alone kept grpc's threads running, ~6 ms of CPU per 15 s idle that every
        replica paid (docs/benchmarks/scale.md, "Replicas")."""
        o = self.options
        self._health_h2 = self._h2_server(health_only=True)
        try:
            self.health_port = await self._health_h2.start(
                o.host, o.grpc_health_port, None, o.reuse_port
            )
        except OSError as error:
            raise OSError(f"cannot bind gRPC port {o.grpc_health_port}: {error}") from None

    def _bind_grpc_health(self) -> None:
        """The health port on grpc.aio (with ext-proc on grpc.aio too); started in start()."""
        o = self.options
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", int(o.reuse_port))])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
        try:
            self.health_port = self._health_server.add_insecure_port(
                f"{o.host}:{o.grpc_health_port}"
            )
        except RuntimeError as error:
            raise OSError(f"cannot bind gRPC port {o.grpc_health_port}: {error}") from None

    async def _start_grpc(self) -> None:
        o = self.options
        server = self._ext_proc_server()
        try:  # grpc raises RuntimeError (older versions return 0) on a busy port
            if o.secure_serving:
                from infergate.epp.server.tls import server_credentials

                credentials, self.certificate = server_credentials(o.cert_path, o.client_ca_file)
                self.grpc_port = server.add_secure_port(f"{o.host}:{o.grpc_port}", credentials)
            else:
                self.grpc_port = server.add_insecure_port(f"{o.host}:{o.grpc_port}")
        except RuntimeError as error:
            raise OSError(f"cannot bind gRPC port {o.grpc_port}: {error}") from None

    async def start(self) -> None:
        o = self.options
        if o.grpc_server == "h2" and _native_installed():
            await self._start_h2()
        else:
            await self._start_grpc()
        if self._h2 is not None:
            await self._start_h2_health()
        else:
            self._bind_grpc_health()
        if self.grpc_port == 0 or self.health_port == 0:
            raise OSError(f"cannot bind gRPC ports {o.grpc_port}/{o.grpc_health_port}")
        await self._update_health()
        self.datastore.subscribe(self._on_endpoints)
        if o.metrics_port >= 0:
            self._metrics_http = _serve_metrics(o.host, o.metrics_port, self.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        await self.scheduler.start()
        await self.collectors.start()
        self.completions.start()
        if o.endpoints_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_endpoints(o.endpoints_file)))
        if o.objectives_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_objectives(o.objectives_file)))
        await asyncio.sleep(0)  # the watches register now: a write just after start is seen
        if o.pool_name:
            from infergate.epp.datalayer.discovery.kube import KubeDiscovery

            self._kube = KubeDiscovery(
                o.pool_name, o.pool_namespace, self.datastore, self.objectives
            )
            await self._kube.start()
        if self._grpc is not None:
            await self._grpc.start()
        if self._health_server is not None:
            await self._health_server.start()
        log.info(
            "endpoint picker serving ext-proc (%s) on %s:%d, health on %d, metrics on %d; "
            "%d endpoints",
            ("mutual TLS" if o.client_ca_file else "TLS") if o.secure_serving else "plaintext",
            o.host,
            self.grpc_port,
            self.health_port,
            self.metrics_port,
            len(self.datastore),
        )

    async def _watch_endpoints(self, path: Path) -> None:
        def reload() -> None:
            try:
                self.datastore.set_endpoints(load_endpoints_file(path))
            except EndpointsFileError as error:
                log.error("keeping the previous endpoints: %s", error)

        await watch_file(path, reload, self._stop)

    async def _watch_objectives(self, path: Path) -> None:
        def reload() -> None:
            try:
                self.objectives.replace(*load_objectives_file(path))
                log.info("objectives reloaded from %s", path)
            except ObjectivesError as error:
                log.error("keeping the previous objectives: %s", error)

        await watch_file(path, reload, self._stop)

    async def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._h2 is not None:
            await self._h2.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._health_h2 is not None:
            await self._health_h2.stop(0)
        if self._kube is not None:
            await self._kube.stop()
        await self.collectors.stop()
        await self.completions.stop()
        await self.scheduler.stop()
        if self.flow is not None:
            await self.flow.close()
        self.record_sweep.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._metrics_http is not None:
            asyncio.get_running_loop().remove_reader(self._metrics_http.fileno())
            self._metrics_http.server_close()
            self._metrics_http = None


def _serve_metrics(host: str, port: int, registry: Any) -> WSGIServer:
    """prometheus_client's metrics server, accepting on the event loop. Its
    ``start_http_server`` runs ``serve_forever`` in a thread that wakes every 0.5 s to look
    for a shutdown, ~1.8 ms of CPU per 15 s idle that every replica paid
    (docs/benchmarks/scale.md, "Replicas"). A scrape is still answered on a thread of its
    own (``ThreadingWSGIServer``), off the loop."""
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import (
        ThreadingWSGIServer,
        _get_best_family,
        _SilentHandler,
        make_wsgi_app,
    )

    class Server(ThreadingWSGIServer):
        """A class of its own: the address family is set on it (as prometheus_client does)."""

    Server.address_family, addr = _get_best_family(host, port)
    server = make_server(addr, port, make_wsgi_app(registry), Server, handler_class=_SilentHandler)
    server.timeout = 0  # handle_request: the loop saw a connection waiting, never block
    asyncio.get_running_loop().add_reader(server.fileno(), server.handle_request)
    return server


def _native_installed() -> bool:
    """``--grpc-server h2`` needs the native module (``native/grpc_h2``); without it the
    EPP still serves, with grpc.aio (the policy: :mod:`infergate.epp.native`)."""
    fallback = "serving ext-proc with grpc.aio (more CPU per request than --grpc-server h2)"
    return load_native("infergate.epp._grpc_h2", fallback) is not None


async def run(options: EppOptions) -> None:
    keep_freed_memory()
    epp = Epp(options)
    await epp.start()
    freeze_heap()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if options.shutdown_delay_s > 0:
        log.info("shutting down: not serving health checks for %.0f s", options.shutdown_delay_s)
        await epp.withdraw()
        await asyncio.sleep(options.shutdown_delay_s)
    log.info("shutting down; streams in flight get %.0f s", options.shutdown_grace_s)
    await epp.stop(options.shutdown_grace_s)
    log.info("stopped")
