"""The pool's ``appProtocol`` decides how the Gateway speaks to the model servers (GIE:
InferencePoolAppProtocol): ``kubernetes.io/h2c`` is HTTP/2 over cleartext (the echo's
h2c port refuses HTTP/1), ``http`` and an omitted appProtocol are HTTP/1.1. Each pod is
pinned in turn and must answer, the Gateway must report it as the served endpoint, and
(infergate's addition) the echo must have seen the protocol the pool asks for."""

from __future__ import annotations

import pytest

from conformance import topology as topo
from conformance.checks import (
    Expected,
    applied,
    eventually,
    pods,
    pool_must_be_accepted_by,
    post,
    route_must_be_accepted_and_resolved,
)
from conformance.drivers.base import Driver

pytestmark = pytest.mark.conformance

BODY = {"model": "conformance-fake-model", "prompt": "Describe San Francisco in one sentence."}
CASES = [
    ("httproute-for-inferencepool-appprotocol-h2c", "appprotocol-h2c.example.com",
     "/inferencepool-app-protocol-h2c", 3001, topo.APPPROTOCOL_H2C_POOL, topo.APPPROTOCOL_APP,
     "HTTP/2.0"),
    ("httproute-for-inferencepool-appprotocol-http", "appprotocol-http.example.com",
     "/inferencepool-app-protocol-http", 3000, topo.APPPROTOCOL_HTTP_POOL, topo.APPPROTOCOL_APP,
     "HTTP/1.1"),
    ("httproute-for-inferencepool-appprotocol-default", "appprotocol-default.example.com",
     "/inferencepool-app-protocol-default", 3000, topo.PRIMARY_POOL, topo.PRIMARY_APP,
     "HTTP/1.1"),
]  # fmt: skip


@pytest.mark.conformance("InferencePoolAppProtocol")
def test_app_protocol(driver: Driver, primary_address: str) -> None:
    with applied(driver, "inferencepool_appprotocol"):
        for route, host, path, port, pool, app, proto in CASES:
            route_must_be_accepted_and_resolved(driver, route, topo.PRIMARY_GATEWAY)
            pool_must_be_accepted_by(driver, pool, topo.PRIMARY_GATEWAY)
            for pod in pods(driver, app):
                selected = f"{pod.ip}:{port}"
                expected = Expected(
                    backend=pod.name, headers={topo.VERIFIER_HEADER: selected}, proto=proto
                )
                reply = eventually(
                    driver, primary_address, post(path, host, selected, BODY), expected
                )
                assert reply.echo["httpPort"] == str(port), reply
