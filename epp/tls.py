"""TLS for the ext-proc port (GIE's ``--secure-serving``).

Gateways that follow GIE's defaults (Istio among them) reach the EPP over TLS without
verifying its certificate, so a self-signed certificate generated at start-up is enough;
``--cert-path`` serves a real one (``tls.crt``/``tls.key``, e.g. a mounted Secret).
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from pathlib import Path

import grpc


def self_signed(hostnames: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a self-signed certificate for it, PEM (key, cert)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "infergate-epp")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hostnames]), False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_credentials(cert_path: Path | None) -> tuple[grpc.ServerCredentials, bytes]:
    """Credentials for the ext-proc port and the certificate they present."""
    key, cert = _key_and_cert(cert_path)
    return grpc.ssl_server_credentials([(key, cert)]), cert


def server_ssl_context(cert_path: Path | None) -> tuple[ssl.SSLContext, bytes]:
    """The same for ``--grpc-server h2``: an SSLContext offering HTTP/2 (ALPN ``h2``)."""
    key, cert = _key_and_cert(cert_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory() as tmp:  # the ssl module loads keys from files only
        (Path(tmp) / "tls.key").write_bytes(key)
        (Path(tmp) / "tls.crt").write_bytes(cert)
        context.load_cert_chain(Path(tmp) / "tls.crt", Path(tmp) / "tls.key")
    return context, cert


def _key_and_cert(cert_path: Path | None) -> tuple[bytes, bytes]:
    if cert_path is not None:
        try:
            key = (cert_path / "tls.key").read_bytes()
            cert = (cert_path / "tls.crt").read_bytes()
        except OSError as error:
            raise OSError(f"--cert-path {cert_path}: {error}") from error
    else:
        key, cert = self_signed()
    return key, cert
