"""The operator provisions mutual TLS between its Envoys and the pool's EPP from one CA.

Pure builders (the Secret, the EPP's flags and mounts, the sidecar's Envoy bootstrap) and
the reconciler's create-once rule, against a stand-in for the API's Secrets collection.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from infergate.epp.server import tls

from infergate.operator import constants as c
from infergate.operator.builders import (
    build_tls_secret,
    desired_objects,
    encode_tls_bundle,
    tls_secret_name,
)
from infergate.operator.eppconfig import DEFAULT_EPP_CONFIG
from infergate.operator.kube import KubeError
from infergate.operator.pool import PoolSpec, parse_pool
from infergate.operator.reconcile import ensure_tls_secret
from infergate.operator.settings import OperatorSettings, memory_bytes

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()
TLS_DATA = encode_tls_bundle(tls.mutual_tls_bundle(server_names=["qwen-pool-epp"]))


def spec(**annotations: str) -> PoolSpec:
    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"].update(uid="u-1", generation=3, annotations=annotations)
    return parse_pool(pool, SETTINGS)


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects if o["kind"] != "ConfigMap"}


def containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    return {container["name"]: container for container in pod["containers"]}


def standalone() -> PoolSpec:
    return spec(**{c.ANNOTATION_STANDALONE_ENVOY: "true"})


def test_secret_holds_one_ca_and_both_pairs_owned_by_the_pool() -> None:
    secret = build_tls_secret(standalone(), TLS_DATA)
    assert secret["metadata"]["name"] == tls_secret_name(standalone())
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert set(secret["data"]) == set(tls.BUNDLE_FILES)
    pem = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    ca = x509.load_pem_x509_certificate(pem[tls.CA_CERT])
    for leaf in (tls.SERVER_CERT, tls.CLIENT_CERT):
        x509.load_pem_x509_certificate(pem[leaf]).verify_directly_issued_by(ca)
    server = x509.load_pem_x509_certificate(pem[tls.SERVER_CERT])
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert tls.EPP_SERVER_NAME in names.get_values_for_type(x509.DNSName)


def test_standalone_pool_gets_mutual_tls_on_both_sides() -> None:
    objects = desired_objects(standalone(), SETTINGS, DEFAULT_EPP_CONFIG, tls=True)
    epp, envoy = containers(objects)["epp"], containers(objects)["envoy"]
    args = epp["args"]
    assert args[args.index("--cert-path") + 1] == c.EPP_TLS_DIR
    assert args[args.index("--client-ca-file") + 1] == f"{c.EPP_TLS_DIR}/{tls.CA_CERT}"
    mount = {"name": "tls", "mountPath": c.EPP_TLS_DIR, "readOnly": True}
    assert mount in epp["volumeMounts"] and mount in envoy["volumeMounts"]
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    assert {
        "name": "tls",
        "secret": {"secretName": tls_secret_name(standalone()), "defaultMode": 0o440},
    } in pod["volumes"]
    envoy_map = next(o for o in objects if o["metadata"]["name"].endswith("-envoy"))
    bootstrap = yaml.safe_load(envoy_map["data"][c.ENVOY_CONFIG_KEY])
    (epp_cluster,) = [
        cl for cl in bootstrap["static_resources"]["clusters"] if cl["name"] == "infergate_epp"
    ]
    context = epp_cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert context["validation_context"]["trusted_ca"]["filename"].endswith(tls.CA_CERT)
    san = context["validation_context"]["match_typed_subject_alt_names"][0]
    assert san["matcher"]["exact"] == tls.EPP_SERVER_NAME
    chain = context["tls_certificates"][0]["certificate_chain"]["filename"]
    assert chain.endswith(tls.CLIENT_CERT)
    heap = bootstrap["overload_manager"]["resource_monitors"][0]["typed_config"]
    assert heap["max_heap_size_bytes"] < memory_bytes(SETTINGS.envoy_memory_limit)


def test_gateway_routed_pool_serves_the_issued_certificate_without_requiring_clients() -> None:
    """Gateways' Envoys hold no client certificate yet (docs/kubernetes.md)."""
    objects = desired_objects(spec(), SETTINGS, DEFAULT_EPP_CONFIG, tls=True)
    args = containers(objects)["epp"]["args"]
    assert "--cert-path" in args and "--client-ca-file" not in args


def test_without_the_secret_the_epp_keeps_its_self_signed_certificate() -> None:
    objects = desired_objects(standalone(), SETTINGS, DEFAULT_EPP_CONFIG)
    assert "--cert-path" not in containers(objects)["epp"]["args"]
    assert "validation_context" not in str(objects)


class Secrets:
    """What ``ensure_tls_secret`` uses of the API: POST into a namespace's Secrets."""

    def __init__(self, status: int | None = None) -> None:
        self.created: list[dict[str, Any]] = []
        self.status = status  # the API's refusal, if any
        self.posts = 0

    def call(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict[str, Any]:
        assert (method, path) == ("POST", "/api/v1/namespaces/default/secrets")
        self.posts += 1
        if self.status is None and any(
            s["metadata"]["name"] == body["metadata"]["name"] for s in self.created
        ):
            self.status = 409
        if self.status is not None:
            raise KubeError(self.status, method, path, "")
        self.created.append(body)
        return body


def test_the_reconciler_creates_the_secret_once_and_never_reads_it() -> None:
    api, pool = Secrets(), standalone()
    assert ensure_tls_secret(api, pool, None)  # type: ignore[arg-type]
    assert ensure_tls_secret(api, pool, None)  # type: ignore[arg-type]  # 409: already there
    (secret,) = api.created
    assert set(secret["data"]) == set(tls.BUNDLE_FILES)
    # Refused (an RBAC without Secrets): the pods keep the self-signed certificate.
    assert not ensure_tls_secret(Secrets(status=403), pool, None)  # type: ignore[arg-type]


def test_a_deployment_that_mounts_the_secret_means_no_new_certificates_and_no_post() -> None:
    """A settled pool (its own Deployment mounts the Secret): a resync or a restarted
    operator neither issues certificates nor POSTs, so the API server sees no write."""
    pool = standalone()
    (deployment,) = [
        o for o in desired_objects(pool, SETTINGS, DEFAULT_EPP_CONFIG, True)
        if o["kind"] == "Deployment"
    ]  # fmt: skip
    api = Secrets()
    assert ensure_tls_secret(api, pool, deployment)  # type: ignore[arg-type]
    assert api.posts == 0
    # Another owner's Deployment of that name proves nothing: the Secret is created.
    foreign = {**deployment, "metadata": {**deployment["metadata"], "ownerReferences": []}}
    api = Secrets()
    assert ensure_tls_secret(api, pool, foreign)  # type: ignore[arg-type]
    assert api.posts == 1
