"""ext-proc over TLS end to end: the EPP's --secure-serving and the Envoy config we generate.

A matching pair routes as usual; a plaintext Envoy in front of a TLS EPP sees the EPP as
unhealthy (gRPC health on the ext-proc port, same transport) and fails fast and visibly
(FailClose: 5xx at once), instead of a health check saying healthy while every request fails.

TLS is mutual under ``infergate up``: a client without a certificate from the stack's CA
(``LocalStack.tls_dir``) gets neither ext-proc nor EDS, while Envoy, which presents one
and verifies the EPP's, serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from infergate.epp.server import tls

from infergate.envoy.bootstrap import EPP_CLUSTER, POOL_CLUSTER, EppMutualTls
from infergate.envoy.process import start_envoy
from infergate.procs import free_port
from infergate.stack.local import LocalStack, StackSpec
from tests.support.probes import envoy_cluster_healthy


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=1,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        secure_serving=True,
        workdir=tmp_path_factory.mktemp("tls-stack"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as stack:
        yield stack


def _eventually(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _completion(base_url: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": "hello over tls", "max_tokens": 4},
        timeout=30,
    )


def _epp_healthy(admin_port: int) -> bool:
    return envoy_cluster_healthy(f"http://127.0.0.1:{admin_port}", EPP_CLUSTER)


def test_tls_epp_behind_tls_envoy_routes(tls_stack: LocalStack) -> None:
    response = _completion(tls_stack.base_url)
    assert response.status_code == 200, response.text
    assert response.headers["x-infergate-picked-endpoint"] == tls_stack.engine_addresses[0]
    assert _epp_healthy(tls_stack.spec.admin_port)


def test_plaintext_envoy_against_tls_epp_is_unhealthy_not_silent(
    tls_stack: LocalStack, tmp_path: Path
) -> None:
    port, admin = free_port(), free_port()
    config = tls_stack.envoy_config(
        epp_tls=False, epp_mtls=None, listen_port=port, admin_port=admin, access_log=False
    )
    envoy = start_envoy(
        tls_stack.group, config, tmp_path / "plain.yaml", log_path=tmp_path / "plain.log"
    )
    try:
        assert _eventually(
            lambda: "/failed_active_hc" in httpx.get(f"http://127.0.0.1:{admin}/clusters").text
        )
        assert not _epp_healthy(admin)
        response = _completion(f"http://127.0.0.1:{port}")
        assert response.status_code >= 500  # FailClose: fast and visible
    finally:
        envoy.stop()
        tls_stack.group.processes.remove(envoy)


def _credentials(tls_dir: Path, with_certificate: bool) -> grpc.ChannelCredentials:
    """A client that trusts the stack's CA, with or without Envoy's client certificate."""
    ca = (tls_dir / tls.CA_CERT).read_bytes()
    if not with_certificate:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        ca, (tls_dir / tls.CLIENT_KEY).read_bytes(), (tls_dir / tls.CLIENT_CERT).read_bytes()
    )


def _channel(port: int, credentials: grpc.ChannelCredentials) -> grpc.Channel:
    options = [("grpc.ssl_target_name_override", tls.EPP_SERVER_NAME)]
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options)


def ext_proc_answers(port: int, credentials: grpc.ChannelCredentials) -> bool:
    """Whether the EPP answers an ext-proc stream (a GET routes on its headers alone)."""
    hv = [base_pb2.HeaderValue(key=":method", raw_value=b"GET")]
    hv.append(base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models"))
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=True)
    )
    with _channel(port, credentials) as channel:
        try:
            reply = next(
                pb_grpc.ExternalProcessorStub(channel).Process(iter([request]), timeout=10)
            )
        except grpc.RpcError:
            return False
    return reply.HasField("request_headers") or reply.HasField("immediate_response")


def eds_endpoints(port: int, credentials: grpc.ChannelCredentials) -> int | None:
    """How many load assignments EDS sends for the pool cluster; None when refused."""
    request = discovery_pb2.DiscoveryRequest(
        type_url="type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        resource_names=[POOL_CLUSTER],
    )
    with _channel(port, credentials) as channel:
        stub = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel)
        try:
            return len(next(stub.StreamEndpoints(iter([request]), timeout=10)).resources)
        except grpc.RpcError:
            return None


def test_client_without_certificate_is_refused_on_ext_proc_and_eds(tls_stack: LocalStack) -> None:
    port, tls_dir = tls_stack.spec.epp_grpc_port, tls_stack.tls_dir
    anonymous = _credentials(tls_dir, with_certificate=False)
    assert not ext_proc_answers(port, anonymous)
    assert eds_endpoints(port, anonymous) is None
    # The same client with the gateway's certificate is served: the certificate decides.
    certified = _credentials(tls_dir, with_certificate=True)
    assert ext_proc_answers(port, certified)
    assert eds_endpoints(port, certified) == 1
    # And Envoy, which presents it and verifies the EPP's, routes.
    assert _completion(tls_stack.base_url).status_code == 200


def test_client_certificate_from_another_ca_is_refused(
    tls_stack: LocalStack, tmp_path: Path
) -> None:
    tls.write_bundle(tmp_path, tls.mutual_tls_bundle())
    ca = (tls_stack.tls_dir / tls.CA_CERT).read_bytes()  # trusts the EPP; foreign client pair
    foreign = grpc.ssl_channel_credentials(
        ca, (tmp_path / tls.CLIENT_KEY).read_bytes(), (tmp_path / tls.CLIENT_CERT).read_bytes()
    )
    assert not ext_proc_answers(tls_stack.spec.epp_grpc_port, foreign)
    assert eds_endpoints(tls_stack.spec.epp_grpc_port, foreign) is None


def test_envoy_refuses_an_epp_certificate_from_another_ca(
    tls_stack: LocalStack, tmp_path: Path
) -> None:
    """Envoy verifies the EPP: with another CA as its trust root the EPP is unhealthy."""
    tls.write_bundle(tmp_path, tls.mutual_tls_bundle())
    mutual = tls_stack.envoy_config()["static_resources"]["clusters"]
    assert any("validation_context" in str(c.get("transport_socket")) for c in mutual)
    port, admin = free_port(), free_port()
    wrong_trust = EppMutualTls(
        ca_file=str(tmp_path / tls.CA_CERT),
        cert_file=str(tls_stack.tls_dir / tls.CLIENT_CERT),
        key_file=str(tls_stack.tls_dir / tls.CLIENT_KEY),
        server_name=tls.EPP_SERVER_NAME,
    )
    config = tls_stack.envoy_config(
        epp_mtls=wrong_trust, listen_port=port, admin_port=admin, access_log=False
    )
    envoy = start_envoy(
        tls_stack.group, config, tmp_path / "wrong-ca.yaml", log_path=tmp_path / "wrong-ca.log"
    )
    try:
        assert _eventually(
            lambda: "/failed_active_hc" in httpx.get(f"http://127.0.0.1:{admin}/clusters").text
        )
        assert not _epp_healthy(admin)
        assert _completion(f"http://127.0.0.1:{port}").status_code >= 500
    finally:
        envoy.stop()
        tls_stack.group.processes.remove(envoy)
