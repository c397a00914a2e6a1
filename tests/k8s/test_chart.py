"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk), and every
rendered built-in object validated against the Kubernetes OpenAPI schemas (custom kinds:
the API server in test_cluster.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.operator import constants as c
from infergate.operator.builders import build_role
from infergate.operator.kube import KINDS, OWNED_KINDS
from infergate.operator.pool import parse_pool
from infergate.operator.settings import OperatorSettings

from .validation import VALUE_SETS, documents, validate_object

helm = pytest.importorskip("helm_python")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "infergate"


def render(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="ig", namespace="infergate", is_install=True)
    return {path: documents(text) for path, text in out.items() if not path.endswith("NOTES.txt")}


def objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [doc for docs in render(values).values() for doc in docs]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_chart_lints_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.32.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == []


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_is_valid(values: dict[str, Any]) -> None:
    rendered = objects(values)
    assert rendered
    for obj in rendered:
        validate_object(obj)


def test_chart_crds_are_the_repository_crds() -> None:
    ours = [
        p
        for p in sorted(
            [*(ROOT / "crds").glob("*.yaml"), *(ROOT / "crds/gateway-api").glob("*.yaml")]
        )
        if p.name != "kustomization.yaml"
    ]
    for path in [*ours, ROOT / "crds/kopf/kopf.dev_peerings.yaml"]:
        assert (CHART / "crds" / path.name).read_text() == path.read_text(), path.name
    assert len(ours) == len(list((CHART / "crds").glob("*.yaml"))) - 1  # + kopf's
    crds = [d for p in sorted((CHART / "crds").glob("*.yaml")) for d in documents(p.read_text())]
    import kubernetes_validate

    for crd in crds:
        kubernetes_validate.validate(crd, "1.32", strict=True)


def test_values_schema_rejects_bad_values() -> None:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({})
    for bad in (
        {"sample": {"mode": "tpu"}},
        {"operator": {"replicas": 0}},
        {"operator": {"logFormat": "xml"}},
        {"sample": {"failureMode": "Sometimes"}},
        {"sample": {"responseAccounting": "full"}},
        {"sample": {"completionEventsPort": 70000}},
        {"sample": {"engine": {"apiKeySecret": "Bad_Name"}}},
        {"gateway": {"serviceType": "ExternalName"}},
        {"gateway": {"xdsPort": 80}},
        {"gatewayClass": {"name": "Not_A_Name"}},
        {"unknownTopLevel": True},
    ):
        with pytest.raises(helm.HelmError):
            chart.validate_schema(bad)


def _kind_rules(clusterrole: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    allowed: dict[tuple[str, str], set[str]] = {}
    for rule in clusterrole["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                allowed.setdefault((group, resource), set()).update(rule["verbs"])
    return allowed


def test_operator_rbac_covers_what_it_does_and_what_it_grants() -> None:
    (clusterrole,) = [
        o
        for o in objects({})
        if o["kind"] == "ClusterRole"
        and not o["metadata"]["name"].endswith(("-discovery", "-gateway"))
    ]
    allowed = _kind_rules(clusterrole)
    # Server-side apply creates or patches; pruning lists and deletes.
    for kind in OWNED_KINDS:
        ref = KINDS[kind]
        assert {"get", "list", "create", "patch", "delete"} <= allowed[(ref.group, ref.plural)], (
            kind
        )
    # kopf watches only the pools, their policy objects, pods, Deployments and Services,
    # and the Gateway API objects the Gateway controller translates.
    watched = {key for key, verbs in allowed.items() if "watch" in verbs}
    assert watched == {
        ("gateway.networking.k8s.io", "gateways"),
        ("gateway.networking.k8s.io", "httproutes"),
        ("gateway.networking.k8s.io", "referencegrants"),
        (c.POOL_GROUP, "inferencepools"),
        (c.X_GROUP, "inferenceobjectives"),
        (c.X_GROUP, "inferencemodelrewrites"),
        ("", "pods"),
        ("", "services"),
        ("apps", "deployments"),
        ("kopf.dev", "kopfpeerings"),
        ("kopf.dev", "clusterkopfpeerings"),
    }
    assert allowed[("", "pods")] == {"get", "list", "watch"}
    assert allowed[("", "secrets")] == {"create"}  # each pool's TLS Secret; never read
    assert all("update" not in verbs and "*" not in verbs for verbs in allowed.values())
    assert "patch" in allowed[(c.POOL_GROUP, "inferencepools/status")]
    assert "patch" in allowed[(c.X_GROUP, "inferenceobjectives/status")]
    assert "patch" in allowed[(c.X_GROUP, "inferencemodelrewrites/status")]
    assert "create" in allowed[("", "events")]
    assert allowed[("gateway.networking.k8s.io", "gateways/status")] == {"patch"}
    assert allowed[("gateway.networking.k8s.io", "httproutes/status")] == {"patch"}
    assert "patch" in allowed[("kopf.dev", "clusterkopfpeerings")]
    # RBAC escalation prevention: the operator must hold every permission it grants.
    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"]["uid"] = "u"
    for rule in build_role(parse_pool(pool, OperatorSettings()))["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= allowed.get((group, resource), set()), (
                    group,
                    resource,
                )


def test_watched_namespaces_get_roles_not_a_cluster_role() -> None:
    rendered = objects({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    kinds = {o["kind"] for o in rendered}
    assert "ClusterKopfPeering" not in kinds
    # At cluster scope only kopf's read-only discovery (CRDs and namespaces) and the
    # cluster-scoped GatewayClasses (read, and their status).
    cluster_roles = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "ClusterRole"}
    assert set(cluster_roles) == {"ig-infergate-discovery", "ig-infergate-gateway"}
    assert _kind_rules(cluster_roles["ig-infergate-discovery"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }
    assert _kind_rules(cluster_roles["ig-infergate-gateway"]) == {
        ("gateway.networking.k8s.io", "gatewayclasses"): {"get", "list", "watch"},
        ("gateway.networking.k8s.io", "gatewayclasses/status"): {"patch"},
    }
    roles = {o["metadata"]["namespace"] for o in rendered if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"] for o in rendered if o["kind"] == "RoleBinding"}
    peerings = {o["metadata"]["namespace"] for o in rendered if o["kind"] == "KopfPeering"}
    assert roles == bindings == peerings == {"team-a", "team-b"}


def test_operator_deployment_runs_the_operator_hardened() -> None:
    rendered = objects(VALUE_SETS["scoped-standalone-ha"])
    (deployment,) = [o for o in rendered if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "operator" and "--standalone" in args
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert any(a.startswith("--liveness=http://0.0.0.0:") for a in args)
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["INFERGATE_EPP_REPLICAS"] == "2"
    assert env["INFERGATE_EPP_EXTRA_ARGS"] == "--refresh-metrics-interval 0.1"
    assert not [o for o in rendered if o["kind"] == "ClusterKopfPeering"]

    default = objects({})
    (peering,) = [o for o in default if o["kind"] == "ClusterKopfPeering"]
    (deployment,) = [o for o in default if o["kind"] == "Deployment"]
    assert (
        f"--peering={peering['metadata']['name']}"
        in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_sample_pool_selects_the_sample_engine_pods() -> None:
    rendered = objects(VALUE_SETS["sample-cpu-gateway"])
    by_kind = {o["kind"]: o for o in rendered}
    pool, engine = (
        by_kind["InferencePool"],
        next(
            o
            for o in rendered
            if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
        ),
    )
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert engine["spec"]["template"]["spec"]["initContainers"][0]["args"][:2] == [
        "engine",
        "make-tiny-model",
    ]
    assert (
        by_kind["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]["name"]
        == pool["metadata"]["name"]
    )
    assert by_kind["InferenceObjective"]["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    gpu = {
        o["kind"]: o
        for o in objects(VALUE_SETS["sample-gpu"])
        if o["metadata"]["name"].endswith("-engine")
    }
    container = gpu["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert "--device=cuda" in container["args"] and container["image"].endswith("-cuda")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_sample_pd_pool_declares_roles_and_gets_the_pd_config() -> None:
    """sample.pd: decode and prefill Deployments (llm-d.ai/role), both selected by the pool,
    each engine with its kv_role; the pool's annotations make the operator generate the
    P/D EndpointPickerConfig."""
    import json

    from infergate.epp.config import parse_config

    from infergate.operator.reconcile import resolve_epp_config

    rendered = objects(VALUE_SETS["sample-pd"])
    pool = next(o for o in rendered if o["kind"] == "InferencePool")
    engines = {
        o["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]: o
        for o in rendered
        if o["kind"] == "Deployment"
        and "llm-d.ai/role" in o["spec"]["template"]["metadata"]["labels"]
    }
    assert set(engines) == {"prefill", "decode"}
    for role, deployment in engines.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        (flag,) = [a for a in args if a.startswith("--kv-transfer-config=")]
        config = json.loads(flag.split("=", 1)[1])
        assert config["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
    assert engines["prefill"]["spec"]["replicas"] == 1
    spec = parse_pool(pool, OperatorSettings())
    assert spec.pd_threshold == 512
    text = resolve_epp_config(None, spec)  # type: ignore[arg-type]
    assert any(p.type == "pd-profile-handler" for p in parse_config(text).plugins)


def test_sample_engines_publish_records_and_the_operator_picks_engine_accounting() -> None:
    """The sample engines run with --completion-events-port and the pool declares it, so
    the operator passes it to the EPP and its standalone Envoy skips the observer filter;
    without records the operator falls back to `observer`; an explicit choice wins."""

    def sample(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        rendered = objects({"sample": {"enabled": True, **values}})
        pool = next(o for o in rendered if o["kind"] == "InferencePool")
        engine = next(
            o
            for o in rendered
            if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
        )
        return pool, engine["spec"]["template"]["spec"]["containers"][0]["args"]

    pool, args = sample({})
    assert "--completion-events-port=5600" in args
    spec = parse_pool(pool, OperatorSettings())
    assert (spec.completion_events_port, spec.response_accounting) == (5600, "engine")
    pool, args = sample({"completionEventsPort": 0})
    assert not any(a.startswith("--completion-events-port") for a in args)
    assert parse_pool(pool, OperatorSettings()).response_accounting == "observer"
    pool, _ = sample({"responseAccounting": "body"})
    assert parse_pool(pool, OperatorSettings()).response_accounting == "body"
    with pytest.raises(helm.HelmError, match="standaloneEnvoy"):
        sample({"responseAccounting": "engine", "standaloneEnvoy": False})


def test_sample_api_key_secret_reaches_engines_and_the_epp() -> None:
    """sample.engine.apiKeySecret: the engines read --api-key from the Secret and the pool
    names it, so the operator gives the EPP the same Secret (for /tokenize)."""
    from infergate.operator.builders import build_deployment

    rendered = objects({"sample": {"enabled": True, "engine": {"apiKeySecret": "engine-key"}}})
    pool = next(o for o in rendered if o["kind"] == "InferencePool")
    engine = next(
        o
        for o in rendered
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
    )
    (env,) = engine["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = {"secretKeyRef": {"name": "engine-key", "key": "api-key"}}
    assert env == {"name": "INFERGATE_API_KEY", "valueFrom": ref}
    spec = parse_pool(pool, OperatorSettings())
    epp = build_deployment(spec, OperatorSettings(), "h")["spec"]["template"]["spec"]
    epp_env = {e["name"]: e for e in epp["containers"][0]["env"]}
    assert epp_env[c.EPP_ENGINE_API_KEY_ENV]["valueFrom"] == ref
    plain = objects({"sample": {"enabled": True}})
    assert all(
        "env" not in o["spec"]["template"]["spec"]["containers"][0]
        for o in plain
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
    )


def test_gateway_controller_values() -> None:
    """gateway.enabled: the GatewayClass, the xDS Service and the operator's settings for
    it; disabled: none of them, the operator told so, and no Gateway API permissions."""
    on = objects({"gatewayClass": {"name": "team-gw"}, "gateway": {"xdsPort": 18123}})
    (gateway_class,) = [o for o in on if o["kind"] == "GatewayClass"]
    assert gateway_class["metadata"]["name"] == "team-gw"
    assert gateway_class["spec"]["controllerName"] == "infergate.io/gateway-controller"
    (xds,) = [o for o in on if o["kind"] == "Service"]
    assert xds["metadata"]["name"] == "ig-infergate-xds"
    assert xds["spec"]["ports"][0]["port"] == 18123
    (deployment,) = [o for o in on if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["INFERGATE_GATEWAY"] == "true"
    assert env["INFERGATE_XDS_PORT"] == "18123"
    assert env["INFERGATE_XDS_ADDRESS"] == "ig-infergate-xds.infergate.svc"
    assert {"name": "xds", "containerPort": 18123, "protocol": "TCP"} in container["ports"]
    assert (
        xds["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    # The settings the chart sets are the operator's own (declared once, in settings.py).
    from infergate.operator.settings import GatewaySettings

    names = set(GatewaySettings().to_env())
    assert {k for k in env if k in names or k.startswith("INFERGATE_XDS")} <= names

    off = objects({"gateway": {"enabled": False}})
    assert not [o for o in off if o["kind"] in ("GatewayClass", "Service")]
    (deployment,) = [o for o in off if o["kind"] == "Deployment"]
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["INFERGATE_GATEWAY"] == "false"
    groups = {
        group
        for o in off
        if o["kind"] in ("ClusterRole", "Role")
        for rule in o["rules"]
        for group in rule["apiGroups"]
    }
    assert "gateway.networking.k8s.io" not in groups
    assert not [
        o for o in objects({"gatewayClass": {"create": False}}) if o["kind"] == "GatewayClass"
    ]
