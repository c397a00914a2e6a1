"""The EPP's default profile behind every data plane it meets (issue 45 item 1).

The default profile picks an ordered list (primary plus fallbacks). GIE's protocol lets
the header or the ``envoy.lb`` metadata carry it; the EPP puts the primary alone in the
``x-gateway-destination-endpoint`` header and the ordered list in the metadata, so each
reader parses what it can. One real stack (simulated engines, the EPP, Envoy), three
configs in front of the same EPP:

* GIE's and llm-d-router's reference Envoy: an ``ORIGINAL_DST`` cluster keyed on the
  header, which dials one address and fails a list with 503 (``UH``);
* infergate's own ``override_host`` config (the stack's Envoy), whose retries walk the
  list from the metadata: a request picked to a SIGKILLed engine is served by the next;
* the Gateway API translator's config for an HTTPRoute to the InferencePool.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.envoy.bootstrap import PICKED_HEADER, UPSTREAM_HOST_HEADER
from infergate.envoy.process import start_envoy
from infergate.gateway.static import static_bootstrap
from infergate.gateway.translate import TranslateOptions, translate
from infergate.gateway.types import ClusterObjects
from infergate.procs import free_port
from infergate.stack.local import LocalStack, StackSpec

# The Gateway tests' object builders (their conftest puts them on the path the same way).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gateway_objects import (
    APPS,
    INFRA,
    gateway,
    gateway_class,
    http_route,
    namespace,
    path,
    pod,
    pool,
    pool_ref,
    rule,
    service,
)

REQUESTS = 20
GW = (INFRA, "gw")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    """Three engines (so a retry past the list's primary has a choice to get right) and
    the EPP with its default profile (no config file)."""
    spec = StackSpec.on_free_ports(
        engines=3,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        epp_args=["--metrics-staleness-threshold", "1.0"],
        workdir=tmp_path_factory.mktemp("interop-wire"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def _complete(client: httpx.Client, prompt: str = "hello there") -> httpx.Response:
    return client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4},
    )


def _all_answered(
    stack: LocalStack, config: dict[str, Any], name: str, listen: int
) -> list[httpx.Response]:
    """Start one more Envoy beside the stack's and send it REQUESTS completions: all 200."""
    assert stack.workdir is not None
    start_envoy(
        stack.group,
        config,
        stack.workdir / f"{name}.yaml",
        name=name,
        log_path=stack.workdir / f"{name}.log",
    )
    with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=60) as client:
        replies = [_complete(client, f"prompt {i}") for i in range(REQUESTS)]
    assert [r.status_code for r in replies] == [200] * REQUESTS, [r.text for r in replies]
    return replies


def test_reference_original_dst_envoy_serves_the_default_profile(stack: LocalStack) -> None:
    """GIE's reference cluster dials the header's one address: every request is a 200,
    and the EPP still named fallbacks (in the metadata)."""
    assert stack.workdir is not None
    listen = free_port()
    config = stack.envoy_config(upstream="original_dst", listen_port=listen, admin_port=free_port())
    replies = _all_answered(stack, config, "envoy-original-dst", listen)
    for reply in replies:
        listed = reply.headers[PICKED_HEADER].split(",")
        assert sorted(listed) == sorted(stack.engine_addresses)  # primary + fallback
        assert reply.headers[UPSTREAM_HOST_HEADER] == listed[0]


def _gateway_world(stack: LocalStack) -> ClusterObjects:
    """An HTTPRoute to an InferencePool of the stack's engines, its EPP the stack's."""
    engine_ports = tuple(int(a.rsplit(":", 1)[1]) for a in stack.engine_addresses)
    return ClusterObjects(
        gateway_classes=(gateway_class(),),
        gateways=(gateway(),),
        http_routes=(http_route("r", rules=[rule([pool_ref("engines")], [path("/v1")])]),),
        inference_pools=(pool("engines", ports=engine_ports, epp=("epp", 9002)),),
        services=(service("epp", ports=[{"port": 9002, "targetPort": stack.spec.epp_grpc_port}]),),
        pods=(
            pod("epp-0", "127.0.0.1", {"app": "epp"}),
            pod("engine-0", "127.0.0.1", {"app": "engines"}),
        ),
        namespaces=(namespace(INFRA), namespace(APPS)),
        gateway_programmed={GW: True},
    )


def test_gateway_translator_serves_the_default_profile(stack: LocalStack) -> None:
    assert stack.workdir is not None
    options = TranslateOptions(epp_tls=False, response_bodies=False, now="2025-01-02T00:00:00Z")
    snapshot = translate(_gateway_world(stack), options).snapshots[GW]
    listen = free_port()
    config = static_bootstrap(snapshot, "infra/gw", admin_port=free_port(), ports={80: listen})
    replies = _all_answered(stack, config, "envoy-gateway", listen)
    served = {r.headers["x-gateway-destination-endpoint-served"] for r in replies}
    assert served <= set(stack.engine_addresses)


def test_override_host_takes_the_fallback_after_an_engine_kill(stack: LocalStack) -> None:
    """Last in the module: it SIGKILLs an engine. A request the EPP still picks to it
    (before the EPP knows) is served by the next endpoint of its list."""
    prompt = "the same long prompt, so prefix affinity keeps picking one engine " * 8
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        first = _complete(client, prompt)
        assert first.status_code == 200, first.text
        victim = first.headers[UPSTREAM_HOST_HEADER]
        process = stack.engines[stack.engine_addresses.index(victim)]
        os.killpg(process.pid, signal.SIGKILL)
        assert process.popen is not None
        process.popen.wait(timeout=30)  # its sockets are closed: a dial is refused
        fallbacks = 0
        for _ in range(REQUESTS):
            reply = _complete(client, prompt)
            assert reply.status_code == 200, reply.text
            listed = reply.headers[PICKED_HEADER].split(",")
            if listed[0] == victim:
                # Picked to the dead engine: served by the next one of the EPP's list
                # (not by whichever engine the no-pick balancer would choose).
                assert reply.headers[UPSTREAM_HOST_HEADER] == listed[1]
                fallbacks += 1
    assert fallbacks > 0  # the EPP's view lags the kill: the fallback path was exercised
