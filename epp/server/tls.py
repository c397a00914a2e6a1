"""TLS for the ext-proc port (GIE's ``--secure-serving``), mutual where a client CA is given.

Gateways that follow GIE's defaults (Istio among them) reach the EPP over TLS without
verifying its certificate, so a self-signed certificate generated at start-up is enough;
``--cert-path`` serves a real one (``tls.crt``/``tls.key``, e.g. a mounted Secret).

The ext-proc port also serves EDS (the pool's endpoints) and drives the EPP's in-flight
accounting, so server-side TLS alone lets any client that can reach the port read the pool
and skew its counts. ``--client-ca-file`` makes TLS mutual: the handshake needs a client
certificate signed by that CA, on ext-proc, EDS and health alike (one port, one
handshake). :func:`mutual_tls_bundle` issues the set both ends need from one fresh CA:
``infergate up`` writes it to its work directory, the operator keeps it in a Secret.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:  # imported where used: the EPP without TLS never loads cryptography
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ec import (
        EllipticCurvePrivateKey,
        EllipticCurvePublicKey,
    )

#: File names of a :func:`mutual_tls_bundle` (also the keys of the operator's Secret):
#: the CA's certificate, the EPP's server pair (what ``--cert-path`` reads) and the
#: gateway's client pair.
CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "tls.crt", "tls.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"
BUNDLE_FILES = (CA_CERT, SERVER_CERT, SERVER_KEY, CLIENT_CERT, CLIENT_KEY)
#: The name every EPP server certificate carries and Envoy checks (its SAN and SNI):
#: one fixed name, so the check does not depend on how Envoy reaches the EPP (loopback,
#: a pod IP, a headless Service's DNS name).
EPP_SERVER_NAME = "infergate-epp"
_VALIDITY = datetime.timedelta(days=3650)


def self_signed(hostnames: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a self-signed certificate for it, PEM (key, cert)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder("infergate-epp", "infergate-epp", key.public_key())
        .add_extension(_san(hostnames, ()), False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), _cert_pem(cert)


def mutual_tls_bundle(
    server_names: Sequence[str] = (), ip_addresses: Sequence[str] = ()
) -> dict[str, bytes]:
    """A fresh CA and the two leaves it signs, PEM by file name (``CA_CERT`` …).

    The server certificate names :data:`EPP_SERVER_NAME` plus ``server_names`` and
    ``ip_addresses`` (for clients that check another name); the client certificate is
    for the gateway. The CA's key is not returned: nothing is issued later, so it is
    dropped here rather than kept where a leak would let anyone mint clients.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        _builder("infergate-epp-ca", "infergate-epp-ca", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
        .add_extension(_key_usage(cert_sign=True), True)
        .sign(ca_key, hashes.SHA256())
    )
    bundle = {CA_CERT: _cert_pem(ca)}
    names = (EPP_SERVER_NAME, *server_names)
    leaves = (
        (SERVER_CERT, SERVER_KEY, EPP_SERVER_NAME, ExtendedKeyUsageOID.SERVER_AUTH, names),
        (CLIENT_CERT, CLIENT_KEY, "infergate-gateway", ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    )
    for cert_file, key_file, common_name, usage, dns in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(common_name, "infergate-epp-ca", key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .add_extension(_key_usage(cert_sign=False), True)
            .add_extension(x509.ExtendedKeyUsage([usage]), False)
        )
        if dns:
            builder = builder.add_extension(_san(dns, ip_addresses), False)
        bundle[cert_file] = _cert_pem(builder.sign(ca_key, hashes.SHA256()))
        bundle[key_file] = _key_pem(key)
    return bundle


def write_bundle(directory: Path, bundle: dict[str, bytes]) -> None:
    """Write ``bundle``'s files into ``directory``; keys readable by their owner only."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in bundle.items():
        path = directory / name
        path.write_bytes(data)
        if name.endswith(".key"):
            path.chmod(0o600)


def server_credentials(
    cert_path: Path | None, client_ca_file: Path | None = None
) -> tuple[grpc.ServerCredentials, bytes]:
    """Credentials for the ext-proc port and the certificate they present; with
    ``client_ca_file`` a client certificate signed by that CA is required."""
    key, cert = _key_and_cert(cert_path)
    if client_ca_file is None:
        return grpc.ssl_server_credentials([(key, cert)]), cert
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=_client_ca(client_ca_file), require_client_auth=True
    )
    return credentials, cert


def server_ssl_context(
    cert_path: Path | None, client_ca_file: Path | None = None
) -> tuple[ssl.SSLContext, bytes]:
    """The same for ``--grpc-server h2``: an SSLContext offering HTTP/2 (ALPN ``h2``)."""
    key, cert = _key_and_cert(cert_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory() as tmp:  # the ssl module loads keys from files only
        (Path(tmp) / "tls.key").write_bytes(key)
        (Path(tmp) / "tls.crt").write_bytes(cert)
        context.load_cert_chain(Path(tmp) / "tls.crt", Path(tmp) / "tls.key")
    if client_ca_file is not None:
        context.load_verify_locations(cadata=_client_ca(client_ca_file).decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context, cert


def _client_ca(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise OSError(f"--client-ca-file {path}: {error}") from error
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise OSError(f"--client-ca-file {path}: no PEM certificate in it")
    return data


def _key_and_cert(cert_path: Path | None) -> tuple[bytes, bytes]:
    if cert_path is not None:
        try:
            key = (cert_path / SERVER_KEY).read_bytes()
            cert = (cert_path / SERVER_CERT).read_bytes()
        except OSError as error:
            raise OSError(f"--cert-path {cert_path}: {error}") from error
    else:
        key, cert = self_signed()
    return key, cert


def _builder(subject: str, issuer: str, public: EllipticCurvePublicKey) -> x509.CertificateBuilder:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def _san(dns: Sequence[str], ips: Sequence[str]) -> x509.SubjectAlternativeName:
    from cryptography import x509

    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    return x509.SubjectAlternativeName(names)


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    """A CA signs certificates; a leaf signs handshakes (ECDSA: digital signature)."""
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _key_pem(key: EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)
