"""Unit tests of the pure parts: pool parsing, builders, status rendering, diffing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.operator import constants as c
from infergate.operator import status as st
from infergate.operator.builders import (
    EPP_PRESTOP_S,
    build_deployment,
    build_pdb,
    build_role,
    build_service,
    desired_objects,
    digest,
)
from infergate.operator.eppconfig import DEFAULT_EPP_CONFIG, InvalidEPPConfig, check_epp_config
from infergate.operator.pool import InvalidPool, PoolSpec, parse_pool
from infergate.operator.reconcile import is_subset, is_up_to_date
from infergate.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()


def body(**annotations: str) -> dict[str, Any]:
    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"].update(uid="u-1", generation=3, annotations=annotations)
    return pool


def spec(**annotations: str) -> PoolSpec:
    return parse_pool(body(**annotations), SETTINGS)


# ------------------------------------------------------------------ pool parsing


def test_parse_reads_the_pool_and_defaults() -> None:
    pool = spec()
    assert (pool.name, pool.namespace, pool.uid, pool.generation) == (
        "qwen-pool",
        "default",
        "u-1",
        3,
    )
    assert pool.match_labels == {"app": "qwen-engine"} and pool.target_ports == (8000,)
    assert (pool.picker_name, pool.picker_port, pool.failure_mode) == (
        "qwen-pool-epp",
        9002,
        "FailClose",
    )
    assert pool.manages_picker and not pool.standalone_envoy and pool.epp_replicas == 1
    assert pool.epp_image == SETTINGS.epp_image


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b["spec"].pop("selector"), "InvalidSelector"),
        (
            lambda b: b["spec"].update(targetPorts=[{"number": 1}, {"number": 1}]),
            "InvalidTargetPorts",
        ),
        (lambda b: b["spec"].update(targetPorts=[]), "InvalidTargetPorts"),
        (lambda b: b["spec"]["endpointPickerRef"].pop("port"), "InvalidExtensionRef"),
        (lambda b: b["spec"].pop("endpointPickerRef"), "EndpointPickerRefMissing"),
        (
            lambda b: b["spec"]["endpointPickerRef"].update(failureMode="Maybe"),
            "InvalidExtensionRef",
        ),
        (
            lambda b: b["spec"]["endpointPickerRef"].update(port={"number": 9090}),
            "InvalidExtensionRef",
        ),
        (
            lambda b: b["metadata"]["annotations"].update({c.ANNOTATION_EPP_REPLICAS: "x"}),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update({c.ANNOTATION_EPP_REPLICAS: "0"}),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update({c.ANNOTATION_STANDALONE_ENVOY: "maybe"}),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update(
                {c.ANNOTATION_COMPLETION_EVENTS_PORT: "70000"}
            ),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update(
                {c.ANNOTATION_COMPLETION_EVENTS_PORT: "zmq"}
            ),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update(
                {c.ANNOTATION_STANDALONE_ENVOY: "true", c.ANNOTATION_RESPONSE_ACCOUNTING: "full"}
            ),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update(
                {c.ANNOTATION_ENGINE_API_KEY_SECRET: "Not_A_Name"}
            ),
            "InvalidAnnotation",
        ),
        (
            lambda b: b["metadata"]["annotations"].update(
                {c.ANNOTATION_ENGINE_API_KEY_SECRET: "keys/bad key"}
            ),
            "InvalidAnnotation",
        ),
        (  # with a Gateway the Gateway's ext-proc settings decide: refused, not ignored
            lambda b: b["metadata"]["annotations"].update(
                {c.ANNOTATION_RESPONSE_ACCOUNTING: "engine"}
            ),
            "InvalidAnnotation",
        ),
    ],
)
def test_parse_rejects_with_a_reason(mutate: Any, reason: str) -> None:
    pool = body()
    mutate(pool)
    with pytest.raises(InvalidPool) as caught:
        parse_pool(pool, SETTINGS)
    assert caught.value.reason == reason and caught.value.message


def test_envoy_port_clash_only_matters_in_standalone_mode() -> None:
    pool = body()
    pool["spec"]["endpointPickerRef"]["port"] = {"number": 8081}
    parse_pool(pool, SETTINGS)
    pool["metadata"]["annotations"] = {c.ANNOTATION_STANDALONE_ENVOY: "true"}
    with pytest.raises(InvalidPool, match="standalone Envoy"):
        parse_pool(pool, SETTINGS)


# ------------------------------------------------------------------ builders


def test_desired_objects_are_owned_labelled_and_hashed() -> None:
    objects = desired_objects(spec(), SETTINGS, DEFAULT_EPP_CONFIG)
    assert [o["kind"] for o in objects] == [
        "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service",
    ]  # fmt: skip
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "default" and meta["name"] == "qwen-pool-epp"
        assert meta["ownerReferences"][0]["uid"] == "u-1"
        assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"][c.LABEL_POOL] == "qwen-pool"
        assert len(meta["annotations"][c.ANNOTATION_SPEC_HASH]) == 16
    # Pure: same input, same output (so resyncs compare equal).
    assert objects == desired_objects(spec(), SETTINGS, DEFAULT_EPP_CONFIG)


def test_a_deleted_epp_serves_on_then_drains_its_streams_within_the_grace_period() -> None:
    """Rolling an EPP fails no request: the old pod keeps serving while the proxies' EDS
    drops it (preStop sleep), then stops accepting and gives the streams in flight the
    operator's drain time; the kubelet's grace period covers both."""
    settings = OperatorSettings(drain_seconds=120)
    deployment = build_deployment(spec(), settings, "abc")
    pod = deployment["spec"]["template"]["spec"]
    (epp,) = pod["containers"]
    assert epp["lifecycle"]["preStop"] == {"sleep": {"seconds": EPP_PRESTOP_S}}
    assert float(epp["args"][epp["args"].index("--shutdown-grace-s") + 1]) == 120
    assert float(epp["args"][epp["args"].index("--shutdown-delay-s") + 1]) > 0
    assert pod["terminationGracePeriodSeconds"] > EPP_PRESTOP_S + 120
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    # The old EPP goes only after the new one has been Ready a while (proxies check it).
    assert deployment["spec"]["minReadySeconds"] >= 5


def test_deployment_is_hardened_and_wired() -> None:
    deployment = build_deployment(spec(), SETTINGS, "abc")
    pod = deployment["spec"]["template"]["spec"]
    (epp,) = pod["containers"]
    assert epp["args"] == [
        "epp", "--pool-name", "qwen-pool", "--pool-namespace", "default",
        "--config-file", "/etc/infergate/epp/config.yaml",
        "--grpc-port", "9002", "--grpc-health-port", "9003", "--metrics-port", "9090",
        "--secure-serving", "--shutdown-delay-s", "5", "--shutdown-grace-s", "300.0",
    ]  # fmt: skip
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert epp["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    # Liveness waits for the first answer (a slow start is not a dead process).
    assert epp["startupProbe"]["grpc"] == epp["livenessProbe"]["grpc"]
    assert epp["startupProbe"]["periodSeconds"] * epp["startupProbe"]["failureThreshold"] >= 60
    security = epp["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    assert (
        pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    )
    assert epp["resources"]["requests"]["cpu"] and epp["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == "qwen-pool-epp"
    assert (
        deployment["spec"]["template"]["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH] == "abc"
    )
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_config_change_rolls_the_pods() -> None:
    a = {o["kind"]: o for o in desired_objects(spec(), SETTINGS, DEFAULT_EPP_CONFIG)}
    b = {
        o["kind"]: o for o in desired_objects(spec(), SETTINGS, DEFAULT_EPP_CONFIG + "# changed\n")
    }
    hash_of = lambda d: d["spec"]["template"]["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH]  # noqa: E731
    assert hash_of(a["Deployment"]) != hash_of(b["Deployment"])


def test_service_exposes_the_referenced_port_as_grpc() -> None:
    service = build_service(spec())
    grpc = service["spec"]["ports"][0]
    assert (grpc["port"], grpc["targetPort"], grpc["appProtocol"]) == (9002, 9002, "http2")
    assert {p["port"] for p in service["spec"]["ports"]} == {9002, 9090}


def test_role_is_read_only_and_namespaced() -> None:
    role = build_role(spec())
    assert role["kind"] == "Role"
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs == {"get", "list", "watch"}
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert resources == {"pods", "inferencepools", "inferenceobjectives", "inferencemodelrewrites"}


def test_pdb_only_with_several_replicas() -> None:
    assert build_pdb(spec()) is None
    pdb = build_pdb(spec(**{c.ANNOTATION_EPP_REPLICAS: "3"}))
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1


def test_standalone_envoy_adds_sidecar_config_and_port() -> None:
    pytest.importorskip("infergate.envoy.bootstrap")
    pool = spec(**{c.ANNOTATION_STANDALONE_ENVOY: "true"})
    objects = {
        (o["kind"], o["metadata"]["name"]): o
        for o in desired_objects(pool, SETTINGS, DEFAULT_EPP_CONFIG)
    }
    bootstrap = yaml.safe_load(objects[("ConfigMap", "qwen-pool-epp-envoy")]["data"]["envoy.yaml"])
    clusters = {cl["name"] for cl in bootstrap["static_resources"]["clusters"]}
    assert clusters, "the bootstrap defines clusters"
    containers = objects[("Deployment", "qwen-pool-epp")]["spec"]["template"]["spec"]["containers"]
    assert [x["name"] for x in containers] == ["epp", "envoy"]
    assert containers[1]["securityContext"]["readOnlyRootFilesystem"] is True
    ports = objects[("Service", "qwen-pool-epp")]["spec"]["ports"]
    assert 8081 in [p["port"] for p in ports]


def _sidecar(pool: PoolSpec) -> tuple[list[str], list[str]]:
    """The EPP container's args and the sidecar Envoy's HTTP filter names."""
    objects = {
        (o["kind"], o["metadata"]["name"]): o
        for o in desired_objects(pool, SETTINGS, DEFAULT_EPP_CONFIG)
    }
    bootstrap = yaml.safe_load(objects[("ConfigMap", "qwen-pool-epp-envoy")]["data"]["envoy.yaml"])
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    containers = objects[("Deployment", "qwen-pool-epp")]["spec"]["template"]["spec"]["containers"]
    return containers[0]["args"], [f["name"] for f in hcm["http_filters"]]


def test_response_accounting_is_observer_unless_engines_publish_records() -> None:
    pytest.importorskip("infergate.envoy.bootstrap")
    standalone = {c.ANNOTATION_STANDALONE_ENVOY: "true"}
    # Engines unknown (vLLM publishes no completion records): the observer filter.
    args, filters = _sidecar(spec(**standalone))
    assert "infergate.ext_proc.observer" in filters
    assert "--completion-events-port" not in args
    # The pool declares its engines' records port: engine accounting, EPP subscribed.
    pool = spec(**standalone, **{c.ANNOTATION_COMPLETION_EVENTS_PORT: "5557"})
    assert pool.response_accounting == "engine"
    args, filters = _sidecar(pool)
    assert "infergate.ext_proc.observer" not in filters
    assert filters.count("envoy.filters.http.ext_proc") == 1
    assert args[args.index("--completion-events-port") + 1] == "5557"
    # An explicit choice wins over the default, either way.
    pool = spec(
        **standalone,
        **{
            c.ANNOTATION_COMPLETION_EVENTS_PORT: "5557",
            c.ANNOTATION_RESPONSE_ACCOUNTING: "Observer",
        },
    )
    assert pool.response_accounting == "observer"
    assert "infergate.ext_proc.observer" in _sidecar(pool)[1]
    pool = spec(**standalone, **{c.ANNOTATION_RESPONSE_ACCOUNTING: "engine"})
    assert "infergate.ext_proc.observer" not in _sidecar(pool)[1]


def test_completion_port_reaches_the_epp_without_a_sidecar_too() -> None:
    pool = spec(**{c.ANNOTATION_COMPLETION_EVENTS_PORT: "5557"})
    container = build_deployment(pool, SETTINGS, "h")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--completion-events-port") + 1] == "5557"


@pytest.mark.parametrize(
    ("annotation", "ref"),
    [
        ("engine-keys", {"name": "engine-keys", "key": "api-key"}),
        ("engine-keys/token", {"name": "engine-keys", "key": "token"}),
    ],
)
def test_engine_api_key_reaches_the_epp_from_a_secret(annotation: str, ref: dict[str, str]) -> None:
    pool = spec(**{c.ANNOTATION_ENGINE_API_KEY_SECRET: annotation})
    container = build_deployment(pool, SETTINGS, "h")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env[c.EPP_ENGINE_API_KEY_ENV]["valueFrom"] == {"secretKeyRef": ref}
    assert "value" not in env[c.EPP_ENGINE_API_KEY_ENV]  # never inlined
    plain = build_deployment(spec(), SETTINGS, "h")["spec"]["template"]["spec"]["containers"][0]
    assert c.EPP_ENGINE_API_KEY_ENV not in {e["name"] for e in plain["env"]}


def test_operator_accounting_values_match_the_bootstrap() -> None:
    bootstrap = pytest.importorskip("infergate.envoy.bootstrap")
    assert set(c.RESPONSE_ACCOUNTING) == set(bootstrap.RESPONSE_ACCOUNTING)


@pytest.mark.parametrize("replicas", ["1", "2"])
@pytest.mark.parametrize("standalone", ["false", "true"])
def test_every_built_object_is_valid_kubernetes(replicas: str, standalone: str) -> None:
    import kubernetes_validate

    if standalone == "true":
        pytest.importorskip("infergate.envoy.bootstrap")
    pool = spec(**{c.ANNOTATION_EPP_REPLICAS: replicas, c.ANNOTATION_STANDALONE_ENVOY: standalone})
    for obj in desired_objects(pool, SETTINGS, DEFAULT_EPP_CONFIG):
        kubernetes_validate.validate(obj, "1.32", strict=True)


# ------------------------------------------------------------------ EPP config


def test_default_epp_config_passes_and_garbage_does_not() -> None:
    check_epp_config(DEFAULT_EPP_CONFIG, "default")
    with pytest.raises(InvalidEPPConfig):
        check_epp_config("kind: [unclosed", "user")
    with pytest.raises(InvalidEPPConfig):
        check_epp_config("- a list\n", "user")


# ------------------------------------------------------------------ status


def test_transition_time_moves_only_when_status_flips() -> None:
    conds = [st.true("Accepted", "Accepted", "ok"), st.false("Ready", "Pending", "wait")]
    first = st.build_parents([], conds, 1, 0, now="2026-01-01T00:00:00Z")
    again = st.build_parents(first, conds, 1, 0, now="2026-01-01T00:05:00Z")
    assert again == first  # nothing changed → byte-identical → no write
    flipped = st.build_parents(
        first,
        [conds[0], st.true("Ready", "EndpointPickerAvailable", "up")],
        2,
        1,
        now="2026-01-01T00:09:00Z",
    )
    by_type = {x["type"]: x for x in flipped[0]["conditions"]}
    assert by_type["Accepted"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert by_type["Ready"]["lastTransitionTime"] == "2026-01-01T00:09:00Z"
    assert {x["observedGeneration"] for x in flipped[0]["conditions"]} == {2}
    assert [x["type"] for x in st.changed_conditions(first, flipped)] == ["Ready"]


def test_other_controllers_parent_entries_are_kept() -> None:
    gateway = {"parentRef": {"name": "gw"}, "controllerName": "example.com/gw", "conditions": []}
    parents = st.build_parents([gateway], [st.true("Accepted", "Accepted", "ok")], 1, None)
    assert parents[1] == gateway
    assert parents[0]["parentRef"] == c.OPERATOR_PARENT_REF
    assert parents[0]["controllerName"] == c.CONTROLLER_NAME


# ------------------------------------------------------------------ diffing


def test_up_to_date_needs_same_hash_and_no_drift() -> None:
    (config_map, *_) = desired_objects(spec(), SETTINGS, DEFAULT_EPP_CONFIG)
    live = copy.deepcopy(config_map)
    live["metadata"].update(uid="x", resourceVersion="9", managedFields=[])  # server-added
    assert is_up_to_date(live, config_map)
    drifted = copy.deepcopy(live)
    drifted["data"]["config.yaml"] = "edited by hand"
    assert not is_up_to_date(drifted, config_map)
    assert not is_up_to_date(None, config_map)
    assert is_subset({"a": [1, {"b": 2}]}, {"a": [1, {"b": 2, "c": 3}], "d": 4})
    assert not is_subset({"a": [1]}, {"a": [1, 2]})
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})


def test_cli_defaults_and_peering_priority() -> None:
    from infergate.operator.cli import kopf_argv

    argv = kopf_argv([])
    assert argv[:3] == ["run", "--module", "infergate.operator.handlers"]
    assert "--all-namespaces" in argv and "--log-format=json" in argv
    scoped = kopf_argv(["--namespace", "a", "--log-format=plain"])
    assert "--all-namespaces" not in scoped and "--log-format=json" not in scoped
    peered = [a for a in kopf_argv(["--peering", "x"]) if a.startswith("--priority=")]
    assert len(peered) == 1 and int(peered[0].split("=")[1]) > 0
    assert not [
        a for a in kopf_argv(["--peering", "x", "--priority", "5"]) if a.startswith("--priority=")
    ]


def test_policy_conditions() -> None:
    from infergate.operator.policy import policy_condition

    objective = {"kind": "InferenceObjective", "spec": {"poolRef": {"name": "p"}}}
    assert policy_condition(objective, True).status == "True"
    assert policy_condition(objective, False).reason == "PoolNotFound"
    rewrite = {"kind": "InferenceModelRewrite", "spec": {"poolRef": {"name": "p", "kind": "Other"}}}
    cond = policy_condition(rewrite, True)
    assert (cond.type, cond.status, cond.reason) == ("Accepted", "False", "UnsupportedPoolRef")


def test_standalone_envoy_with_replicas_dials_every_replica_through_a_headless_service() -> None:
    pytest.importorskip("infergate.envoy.bootstrap")
    pool = spec(**{c.ANNOTATION_STANDALONE_ENVOY: "true", c.ANNOTATION_EPP_REPLICAS: "3"})
    objects = {
        (o["kind"], o["metadata"]["name"]): o
        for o in desired_objects(pool, SETTINGS, DEFAULT_EPP_CONFIG)
    }
    headless = objects[("Service", "qwen-pool-epp-replicas")]["spec"]
    assert headless["clusterIP"] == "None" and headless["ports"][0]["port"] == 9002
    assert objects[("Deployment", "qwen-pool-epp")]["spec"]["replicas"] == 3
    bootstrap = yaml.safe_load(objects[("ConfigMap", "qwen-pool-epp-envoy")]["data"]["envoy.yaml"])
    (epp,) = [
        cl for cl in bootstrap["static_resources"]["clusters"] if cl["name"] == "infergate_epp"
    ]
    hosts = [
        e["endpoint"]["address"]["socket_address"]["address"]
        for e in epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == ["127.0.0.1", "qwen-pool-epp-replicas.default.svc"]
    assert epp["type"] == "STRICT_DNS" and "outlier_detection" in epp
    # One replica: no headless Service, the sidecar dials its own EPP only.
    single = desired_objects(
        spec(**{c.ANNOTATION_STANDALONE_ENVOY: "true"}), SETTINGS, DEFAULT_EPP_CONFIG
    )
    assert [o for o in single if o["metadata"]["name"].endswith("-replicas")] == []
