"""The routers the lab compares, each started in front of a running fleet of engines.

* ``round-robin`` / ``least-request`` — the real Envoy with a static cluster of the
  engines and its own ``ROUND_ROBIN`` / ``LEAST_REQUEST`` load balancer (the listener,
  timeouts and router are the gateway's, minus ext_proc).
* ``sglang-cache-aware`` — sglang-router (``python -m sglang_router.launch_router
  --policy cache_aware``), the Rust router users pick for cache-aware routing; skipped
  with a message when the ``sglang-router`` package is not installed.
* ``epp-gie`` / ``epp-infergate`` — the real Envoy + our EPP with GIE's default profile
  or infergate's default; ``epp-precise`` adds the engines' KV events (the engines of its
  fleet publish them); ``epp:PATH`` runs the EPP with any EndpointPickerConfig file (a
  file that uses ``precise-prefix-cache-scorer`` needs ``epp:builtin:…`` or KV events
  are not published).
* ``external-epp`` — any external ext-proc Endpoint Picker binary (llm-d-router's or GIE's
  Go ``epp``, ``--external-epp PATH``) with its file discovery of the fleet, behind the
  same Envoy through GIE's reference ORIGINAL_DST cluster
  (:mod:`infergate.bench.routing.external`); skipped with a message when no binary is
  given.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infergate.bench.routing import external
from infergate.envoy.bootstrap import EPP_CLUSTER, POOL_CLUSTER
from infergate.envoy.process import start_envoy
from infergate.procs import free_port, http_ready
from infergate.stack.local import LOOPBACK, LocalStack, grpc_serving


def direct_twin(config: dict[str, Any]) -> dict[str, Any]:
    """The gateway config minus ext_proc and the EPP-fed pool cluster: every request takes
    the no-pick route to the fallback cluster (the same upstreams), through the same
    listener and router. The Envoy-only routers (round-robin, least-request) run it."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    hcm["typed_config"]["http_filters"] = [  # the routing filter and the observer
        f for f in filters if not f["typed_config"]["@type"].endswith(".ExternalProcessor")
    ]
    for host in hcm["typed_config"]["route_config"]["virtual_hosts"]:
        host["routes"] = [
            r for r in host["routes"] if r.get("route", {}).get("cluster") != POOL_CLUSTER
        ]
    config["static_resources"]["clusters"] = [
        c
        for c in config["static_resources"]["clusters"]
        if c["name"] not in (EPP_CLUSTER, POOL_CLUSTER)
    ]
    return config


class RouterUnavailable(RuntimeError):
    """The router cannot run here (a package is missing); the message says how to fix it."""


@dataclass(frozen=True)
class Router:
    name: str
    description: str
    start: Callable[[LocalStack], str]  # starts it in the stack's process group; base URL
    kv_events: bool = False  # the engines must publish KV events (precise prefix routing)
    epp: bool = False  # our EPP (it can run as several replicas: --epp-replicas)


def _envoy_lb(policy: str) -> Callable[[LocalStack], str]:
    def start(stack: LocalStack) -> str:
        assert stack.workdir is not None
        port = free_port()
        config = direct_twin(
            stack.envoy_config(
                listen_port=port, admin_port=free_port(), failure_mode_allow=True, access_log=False
            )
        )
        for cluster in config["static_resources"]["clusters"]:
            cluster["lb_policy"] = policy
        start_envoy(stack.group, config, stack.workdir / f"envoy-{policy.lower()}.yaml",
                    name=f"envoy-{policy.lower()}")  # fmt: skip
        return f"http://{LOOPBACK}:{port}"

    return start


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def _sglang(stack: LocalStack) -> str:
    if not sglang_available():
        raise RouterUnavailable(
            "sglang-router is not installed: `pip install sglang-router` (the dev extra has it)"
        )
    port = free_port()
    argv = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", LOOPBACK, "--port", str(port),
        "--policy", "cache_aware",
        "--worker-urls", *stack.engine_urls,
        "--log-level", "warn",
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    assert stack.workdir is not None
    stack.group.start(
        "sglang-router",
        argv,
        ready=http_ready(f"http://{LOOPBACK}:{port}/health"),
        timeout=60.0,
        log_path=stack.workdir / "sglang-router.log",
    )
    return f"http://{LOOPBACK}:{port}"


def _epp(config: str) -> Callable[[LocalStack], str]:
    """The EPP behind the real Envoy; ``config`` is ``builtin:NAME`` or a file path."""

    def start(stack: LocalStack) -> str:
        stack.spec.epp_config_file = Path(config)
        stack.start_gateway()
        return stack.base_url

    return start


def _external_epp(binary: Path | None, config: Path | None) -> Callable[[LocalStack], str]:
    """The external EPP on the stack's EPP ports, and Envoy in front with GIE's reference
    upstream (ORIGINAL_DST) and response bodies streamed to the EPP, as the peer expects."""

    def start(stack: LocalStack) -> str:
        found = external.find_binary(binary)
        if found is None:
            where = f"{binary} is not an executable file; " if binary is not None else ""
            raise RouterUnavailable(where + external.BUILD_HINT)
        assert stack.workdir is not None
        endpoints = stack.workdir / "peer-endpoints.yaml"
        endpoints.write_text(yaml.safe_dump(external.endpoints_document(stack.engine_addresses)))
        config_file = stack.workdir / "peer-epp-config.yaml"
        document = external.with_file_discovery(external.load_config(config), endpoints)
        config_file.write_text(yaml.safe_dump(document, sort_keys=False))
        spec = stack.spec
        argv = external.epp_argv(
            found,
            config_file,
            grpc_port=spec.epp_grpc_port,
            health_port=spec.epp_health_port,
            metrics_port=spec.epp_metrics_port,
        )
        try:
            stack.epp = stack.group.start(
                "external-epp",
                argv,
                ready=grpc_serving(LOOPBACK, spec.epp_health_port),
                timeout=60.0,
                log_path=stack.workdir / "external-epp.log",
            )
        except OSError as error:  # not a program for this machine (exec failed)
            raise RouterUnavailable(f"cannot run {found}: {error}; {external.BUILD_HINT}") from None
        envoy_config = stack.envoy_config(
            upstream="original_dst",
            response_accounting="body",
            failure_mode_allow=False,
            epp_health_check_interval_s=None,  # the peer answers gRPC health on its own port
            access_log=False,
        )
        stack.envoy = start_envoy(
            stack.group, envoy_config, stack.workdir / "envoy-external-epp.yaml",
            name="envoy-external-epp", log_path=stack.workdir / "envoy-external-epp.log",
        )  # fmt: skip
        return stack.base_url

    return start


def external_router(binary: Path | None, config: Path | None = None) -> Router:
    """The ``external-epp`` router for ``binary`` (None: it will be skipped, saying why)."""
    described = f"external EPP {binary.name if binary else '(no --external-epp)'}"
    if config is not None:
        described += f", {config.name}"
    return Router("external-epp", described, _external_epp(binary, config))


ROUTERS: dict[str, Router] = {
    r.name: r
    for r in (
        Router("round-robin", "Envoy ROUND_ROBIN", _envoy_lb("ROUND_ROBIN")),
        Router("least-request", "Envoy LEAST_REQUEST", _envoy_lb("LEAST_REQUEST")),
        Router("sglang-cache-aware", "sglang-router --policy cache_aware", _sglang),
        Router(
            "epp-gie", "infergate EPP, GIE's default profile", _epp("builtin:gie-default"), epp=True
        ),
        Router(
            "epp-infergate",
            "infergate EPP, infergate's default profile",
            _epp("builtin:infergate-default"),
            epp=True,
        ),
        Router(
            "epp-precise",
            "infergate EPP, default profile plus the engines' KV events (up --precise-prefix)",
            _epp("builtin:precise-prefix"),
            kv_events=True,
            epp=True,
        ),
        Router(
            "epp-lora",
            "infergate EPP, builtin:lora (now a name for the default, which has LoRA affinity)",
            _epp("builtin:lora"),
            epp=True,
        ),
        external_router(None),
    )
}

#: What the lab runs when no --router is given (epp-precise on request: it needs engines
#: that publish KV events, and the others do not use them).
DEFAULT_ROUTERS = ("round-robin", "least-request", "sglang-cache-aware", "epp-gie", "epp-infergate")


def resolve(
    name: str, *, external_epp: Path | None = None, external_epp_config: Path | None = None
) -> Router:
    """A router by name, or ``epp:PATH`` for the EPP with that EndpointPickerConfig file;
    ``external-epp`` runs ``external_epp`` with ``external_epp_config`` (or its default)."""
    if name == "external-epp":
        if external_epp_config is not None:
            external.load_config(external_epp_config)  # refuse a bad file now, not mid-run
        return external_router(external_epp, external_epp_config)
    if name in ROUTERS:
        return ROUTERS[name]
    if name.startswith("epp:"):
        path = name[4:]
        if not path.startswith("builtin:") and not Path(path).is_file():
            raise ValueError(f"router {name!r}: no EndpointPickerConfig file at {path}")
        precise = path == "builtin:precise-prefix" or path == "builtin:gie-precise-prefix"
        return Router(name, f"infergate EPP, {path}", _epp(path), kv_events=precise, epp=True)
    raise ValueError(
        f"unknown router {name!r}: choose from {', '.join(ROUTERS)} or epp:CONFIG.yaml"
    )
