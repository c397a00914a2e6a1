"""``--client-ca-file``: the ext-proc port requires a client certificate, on both servers.

The e2e twin (tests/e2e/test_tls.py) runs it behind Envoy under ``infergate up``; here one
EPP per gRPC server (h2, aio) with the same bundle, and the control: without a client CA
the same anonymous client is served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from infergate.epp.server import tls
from infergate.epp.types import Endpoint

from ..e2e.test_tls import eds_endpoints, ext_proc_answers
from .conftest import EppFactory

A = Endpoint("127.0.0.1", 18001)


def _anonymous(directory: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials((directory / tls.CA_CERT).read_bytes())


def _certified(directory: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (directory / tls.CA_CERT).read_bytes(),
        (directory / tls.CLIENT_KEY).read_bytes(),
        (directory / tls.CLIENT_CERT).read_bytes(),
    )


@pytest.mark.parametrize("server", ["h2", "aio"])
async def test_client_certificate_required_when_a_client_ca_is_given(
    epp_factory: EppFactory, tmp_path: Path, server: str
) -> None:
    tls.write_bundle(tmp_path, tls.mutual_tls_bundle())
    mutual = await epp_factory(
        static_endpoints=[A],
        secure_serving=True,
        cert_path=tmp_path,
        client_ca_file=tmp_path / tls.CA_CERT,
        grpc_server=server,
    )
    port = mutual.grpc_port
    assert not await asyncio.to_thread(ext_proc_answers, port, _anonymous(tmp_path))
    assert await asyncio.to_thread(eds_endpoints, port, _anonymous(tmp_path)) is None
    assert await asyncio.to_thread(ext_proc_answers, port, _certified(tmp_path))
    assert await asyncio.to_thread(eds_endpoints, port, _certified(tmp_path)) == 1
    # Control: server-only TLS (no client CA) serves the anonymous client.
    plain = await epp_factory(
        static_endpoints=[A], secure_serving=True, cert_path=tmp_path, grpc_server=server
    )
    assert await asyncio.to_thread(ext_proc_answers, plain.grpc_port, _anonymous(tmp_path))


def test_client_ca_file_without_secure_serving_is_a_clear_error(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from infergate.cli import app

    args = ["epp", "--endpoint", "127.0.0.1:1", "--client-ca-file", str(tmp_path / "ca.crt")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--client-ca-file needs --secure-serving" in result.output
