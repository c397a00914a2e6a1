"""The loopback data plane the control-plane driver runs (and what CI runs).

* **Pods** are echo servers (``conformance/echo/server.py``), one process per pod, each
  bound to the pod's loopback IP (``127.X.Y.N``: Linux routes all of 127/8 to ``lo``), so
  pod IPs are distinct as in a cluster and GIE's ports (3000, 3002, 3004) are used as is.
* **Each pool** runs the Endpoint Picker the operator deployed for it: the container
  args of the operator's EPP Deployment (``--pool-name``/``--pool-namespace``: Kubernetes
  discovery against the API server; ports rebound to free loopback ports) and the
  EndpointPickerConfig from the operator's ConfigMap. In front of it, a real Envoy
  whose bootstrap is :func:`infergate.envoy.bootstrap.build_envoy_config` — the
  pool's ``failureMode`` becomes ``failure_mode_allow`` (FailOpen falls back to the
  pool's endpoints). A route of :mod:`conformance.topology` with one pool is that Envoy.
* **Weighted routes** (an HTTPRoute with two InferencePool backendRefs) have no
  counterpart in the per-pool bootstrap: the driver builds one front Envoy listener with
  ``weighted_clusters`` over the two pool listeners, so each request is split by weight
  first and then routed by the chosen pool's own EPP, as a Gateway does.

The API server, the operator and the pods' addresses come from the subclass
(:class:`conformance.drivers.controlplane.ControlPlaneDriver`: the real kube-apiserver).
Everything else starts lazily (status tests need no Envoy) and once per session.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from conformance import topology as topo
from conformance.drivers.base import STOP_PODS, Driver, Pod, Reply
from conformance.kube import KubeApi, wait_for
from infergate.envoy.bootstrap import EnvoyConfig, build_envoy_config
from infergate.envoy.process import start_envoy
from infergate.procs import ManagedProcess, ProcessGroup, free_port, tcp_ready

ECHO_SERVER = topo.HERE / "echo" / "server.py"
_HTTP = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _all_ready(checks: Sequence[Any]) -> Any:
    return lambda: all(check() for check in checks)


def weighted_front_config(
    *, listen_port: int, admin_port: int, backends: Sequence[tuple[str, int, int]]
) -> dict[str, Any]:
    """An Envoy bootstrap splitting requests by weight over pool listeners.

    ``backends`` is ``(name, port, weight)`` per pool listener on 127.0.0.1. This is the
    HTTPRoute backendRef ``weight`` layer that the per-pool bootstrap does not express.
    """
    clusters = [
        {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "5s",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": port,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
        for name, port, _ in backends
    ]
    hcm = {
        "@type": _HTTP,
        "stat_prefix": "weighted_front",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "weighted",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "timeout": "60s",
                                "weighted_clusters": {
                                    "clusters": [
                                        {"name": name, "weight": weight}
                                        for name, _, weight in backends
                                    ]
                                },
                            },
                        }
                    ],
                }
            ]
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "node": {"id": "conformance-weighted-front", "cluster": "conformance"},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "weighted_front",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listen_port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def rebind_epp_args(args: Sequence[str], config: Path, ports: Mapping[str, int]) -> list[str]:
    """The operator's EPP container args, run on this machine: the config file is a local
    copy of the pool's ConfigMap, the ports are free loopback ports."""
    out = list(args)
    for flag, value in [("--config-file", str(config)), *((f, str(p)) for f, p in ports.items())]:
        if flag not in out:
            raise ValueError(f"the operator's EPP args lack {flag}: {list(args)}")
        out[out.index(flag) + 1] = value
    return [*out, "--host", "127.0.0.1"]


class _Epp:
    """One pool's `infergate epp`, restartable on the same ports."""

    def __init__(
        self, name: str, argv: list[str], grpc_port: int, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.grpc_port = grpc_port
        self.env = env
        self.process: ManagedProcess | None = None


class LoopbackDriver(Driver):
    """Echo pods, EPPs and Envoys on loopback; the subclass supplies the API server."""

    capabilities = frozenset({STOP_PODS})
    settle_timeout = 60.0

    def __init__(self, workdir: Path, cli: Sequence[str]) -> None:
        self.workdir = workdir
        self.cli = list(cli)
        self.group = ProcessGroup()
        self._lock = threading.RLock()
        self._http = httpx.Client(timeout=30.0)
        self._pods: dict[str, list[Pod]] = {}
        self._echo: dict[str, ManagedProcess] = {}
        self._epps: dict[str, _Epp] = {}
        self._listeners: dict[str, int] = {}
        self._envoy_configs: dict[str, dict[str, Any]] = {}
        self._plane_up = False
        self._kube: KubeApi | None = None
        self._assign_pods()

    # -- topology ---------------------------------------------------------------------
    def _assign_pods(self) -> None:
        """Bring the API server up and fill ``self._pods`` (and ``self._kube``)."""
        raise NotImplementedError

    def pods(self, pool: str) -> list[Pod]:
        return list(self._pods[pool])

    # -- data plane -------------------------------------------------------------------
    def _start_echo(self, pod: Pod) -> ManagedProcess:
        argv = [sys.executable, str(ECHO_SERVER), "--host", pod.ip, "--pod-name", pod.name,
                "--namespace", topo.APP_NS]  # fmt: skip
        for port in pod.ports:
            argv += ["--port", str(port)]
        process = self.group.start(
            f"echo-{pod.name}", argv, timeout=60.0,
            ready=_all_ready([tcp_ready(pod.ip, port) for port in pod.ports]),
        )  # fmt: skip
        self._echo[pod.name] = process
        return process

    def _start_epp(self, epp: _Epp) -> None:
        epp.process = self.group.start(
            epp.name, epp.argv, ready=tcp_ready("127.0.0.1", epp.grpc_port), timeout=90.0,
            env=epp.env,
        )  # fmt: skip

    def _ensure_data_plane(self) -> None:
        with self._lock:
            if self._plane_up:
                return
            started: set[str] = set()
            for pods in self._pods.values():
                for pod in pods:
                    if pod.name not in started:
                        self._start_echo(pod)
                        started.add(pod.name)
            for pool in topo.pools().values():
                self._start_pool(pool)
            self._start_weighted_routes()
            self._plane_up = True

    def _start_pool(self, pool: topo.PoolModel) -> None:
        """Run the EPP the operator deployed for ``pool``, and an Envoy in front of it."""
        pods = self._pods[pool.name]
        endpoints = [(pod.ip, port) for pod in pods for port in pool.target_ports]
        folder = self.workdir / pool.name
        folder.mkdir(parents=True, exist_ok=True)
        kube = self.kube
        deployment = wait_for(
            lambda: kube.get("Deployment", pool.namespace, pool.picker_service),
            timeout=self.settle_timeout, what=f"the operator's EPP Deployment for {pool.name}",
        )  # fmt: skip
        config_map = kube.get("ConfigMap", pool.namespace, pool.picker_service)
        containers = deployment["spec"]["template"]["spec"]["containers"]
        epp_container = next((c for c in containers if (c.get("args") or [""])[0] == "epp"), None)
        if config_map is None or epp_container is None:
            raise RuntimeError(
                f"the operator's objects for {pool.name} have no EPP container or ConfigMap: "
                f"{[c.get('args') for c in containers]}"
            )
        config_file = folder / "epp-config.yaml"
        config_file.write_text(config_map["data"]["config.yaml"])
        ports = {
            flag: free_port() for flag in ("--grpc-port", "--grpc-health-port", "--metrics-port")
        }
        grpc_port = ports["--grpc-port"]
        epp = _Epp(
            f"epp-{pool.name}",
            [*self.cli, *rebind_epp_args(epp_container["args"], config_file, ports)],
            grpc_port,
        )
        self._epps[pool.name] = epp
        self._start_epp(epp)
        self._mark_available(pool)
        fail_open = pool.failure_mode == "FailOpen"
        listen_port = free_port()
        config = build_envoy_config(
            EnvoyConfig(
                listen_port=listen_port,
                epp_address="127.0.0.1",
                epp_port=grpc_port,
                failure_mode_allow=fail_open,
                admin_port=free_port(),
                listen_address="127.0.0.1",
                fallback_endpoints=endpoints if fail_open else (),
                access_log=True,
                stat_prefix=pool.name.replace("-", "_"),
                # The operator's EPP serves ext-proc over TLS (GIE's default); dial it so.
                epp_tls="--secure-serving" in epp_container["args"],
                response_accounting="observer",  # as the operator's sidecar
            )
        )
        start_envoy(
            self.group, config, folder / "envoy.yaml", name=f"envoy-{pool.name}", timeout=90.0
        )
        self._envoy_configs[pool.name] = config
        for key, route in topo.ROUTES.items():
            if route.pools == (pool.name,):
                self._listeners[key] = listen_port

    def _start_weighted_routes(self) -> None:
        for key, route in topo.ROUTES.items():
            if len(route.backends) < 2:
                continue
            listen_port = free_port()
            config = weighted_front_config(
                listen_port=listen_port,
                admin_port=free_port(),
                backends=[
                    (f"pool_{pool.replace('-', '_')}", self._pool_listener(pool), weight)
                    for pool, weight in route.backends
                ],
            )
            folder = self.workdir / f"route-{key}"
            folder.mkdir(parents=True, exist_ok=True)
            start_envoy(
                self.group, config, folder / "envoy.yaml", name=f"envoy-route-{key}", timeout=90.0
            )
            self._listeners[key] = listen_port

    def _pool_listener(self, pool: str) -> int:
        for key, route in topo.ROUTES.items():
            if route.pools == (pool,) and key in self._listeners:
                return self._listeners[key]
        raise LookupError(f"no single-pool route serves {pool}")

    def send(
        self,
        route: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        method: str = "POST",
    ) -> Reply:
        self._ensure_data_plane()
        spec = topo.ROUTES[route]
        request_headers = {"host": spec.hostname, **(headers or {})}
        url = f"http://127.0.0.1:{self._listeners[route]}{spec.path}"
        if method in ("GET", "HEAD", "DELETE"):
            response = self._http.request(method, url, headers=request_headers)
        else:
            response = self._http.request(
                method,
                url,
                headers=request_headers,
                json=topo.REQUEST_BODY if body is None else body,
            )
        return Reply.build(response.status_code, response.headers, response.content)

    @contextlib.contextmanager
    def epp_unavailable(self, pool: str) -> Iterator[None]:
        self._ensure_data_plane()
        epp = self._epps[pool]
        self._stop(epp.process)
        try:
            yield
        finally:
            self._start_epp(epp)

    @contextlib.contextmanager
    def pod_stopped(self, pod: Pod) -> Iterator[None]:
        self._ensure_data_plane()
        self._stop(self._echo[pod.name])
        try:
            yield
        finally:
            self._start_echo(pod)

    def _stop(self, process: ManagedProcess | None) -> None:
        if process is None:
            return
        process.stop()
        # Forget it, so the final stop_all never signals a process group id that the
        # kernel may have handed to someone else meanwhile.
        with contextlib.suppress(ValueError):
            self.group.processes.remove(process)

    # -- API server + operator ----------------------------------------------------------
    @property
    def kube(self) -> KubeApi:
        assert self._kube is not None, "the API server starts in _assign_pods"
        return self._kube

    def picker_available(self, pool: str) -> None:
        self._ensure_data_plane()
        epp = self._epps[pool]
        if not tcp_ready("127.0.0.1", epp.grpc_port)():
            self._start_epp(epp)
        self._mark_available(topo.pools()[pool])

    def _mark_available(self, pool: topo.PoolModel) -> None:
        """Wait until the operator's EPP Deployment for ``pool`` is Available."""
        raise NotImplementedError

    # -- housekeeping ---------------------------------------------------------------------
    def logs(self) -> Iterator[tuple[str, str]]:
        for process in self.group:
            yield process.name, process.log_tail(3000)

    def close(self) -> None:
        self._http.close()
        self.group.stop_all()
