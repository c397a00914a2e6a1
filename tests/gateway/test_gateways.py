"""GatewayClasses, Gateways and listeners: which are ours, their conditions with the
spec's reasons, and which ports become Envoy listeners."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_objects import (
    APPS,
    INFRA,
    conditions,
    gateway,
    gateway_class,
    http_route,
    listener,
    parent,
    snapshot_resources,
    world,
)

from infergate.gateway.translate import TranslateOptions, translate
from infergate.gateway.types import LISTENER_TYPE, ROUTE_TYPE, Translation

NOW = "2025-01-02T00:00:00Z"
GW = (INFRA, "gw")


def run(options: TranslateOptions | None = None, **overrides: Any) -> Translation:
    return translate(world(**overrides), options or TranslateOptions(now=NOW))


def listener_entry(t: Translation, name: str, key: tuple[str, str] = GW) -> dict[str, Any]:
    return next(x for x in t.gateway_status[key]["listeners"] if x["name"] == name)


def test_other_controllers_are_ignored() -> None:
    t = run(
        gateway_classes=(gateway_class(), gateway_class("theirs", "example.com/other")),
        gateways=(
            gateway(),
            gateway("their-gw", class_name="theirs"),
            gateway("x", class_name="nope"),
        ),
    )
    assert set(t.gateway_class_status) == {"infergate"}
    assert set(t.gateway_status) == {GW}
    assert set(t.snapshots) == {GW}


def test_class_with_parameters_is_refused_and_so_are_its_gateways() -> None:
    t = run(
        gateway_classes=(gateway_class(parametersRef={"group": "x", "kind": "Y", "name": "z"}),)
    )
    assert conditions(t.gateway_class_status["infergate"])["Accepted"] == (
        "False",
        "InvalidParameters",
    )
    assert conditions(t.gateway_status[GW])["Accepted"] == ("False", "Invalid")
    assert GW not in t.snapshots


def test_supported_version_is_reported_when_known() -> None:
    ok = run(TranslateOptions(now=NOW, gateway_api_bundle_version="v1.4.0"))
    assert conditions(ok.gateway_class_status["infergate"])["SupportedVersion"] == (
        "True",
        "SupportedVersion",
    )
    old = run(TranslateOptions(now=NOW, gateway_api_bundle_version="v0.8.0"))
    assert conditions(old.gateway_class_status["infergate"]) == {
        "Accepted": ("True", "Accepted"),
        "SupportedVersion": ("False", "UnsupportedVersion"),
    }
    assert "SupportedVersion" not in conditions(run().gateway_class_status["infergate"])


def test_unsupported_protocol_listener_is_not_programmed() -> None:
    t = run(
        gateways=(
            gateway(listeners=[listener(from_="All"), listener("tls", port=443, protocol="HTTPS")]),
        )
    )
    tls = listener_entry(t, "tls")
    assert conditions(tls)["Accepted"] == ("False", "UnsupportedProtocol")
    assert conditions(tls)["Programmed"] == ("False", "Invalid")
    assert tls["supportedKinds"] == []
    assert conditions(t.gateway_status[GW])["Accepted"] == ("True", "ListenersNotValid")
    assert set(snapshot_resources(t.snapshots[GW], LISTENER_TYPE)) == {"http-80"}


def test_gateway_with_no_valid_listener_is_not_accepted() -> None:
    t = run(gateways=(gateway(listeners=[listener("tcp", port=9000, protocol="TCP")]),))
    assert conditions(t.gateway_status[GW]) == {
        "Accepted": ("False", "ListenersNotValid"),
        "Programmed": ("False", "Invalid"),
    }
    assert GW not in t.snapshots


def test_protocol_conflict_rejects_every_listener_on_the_port() -> None:
    t = run(
        gateways=(
            gateway(
                listeners=[
                    listener("a", port=80, from_="All"),
                    listener("b", port=80, protocol="HTTPS"),
                    listener("c", port=81, from_="All"),
                ]
            ),
        )
    )
    for name in ("a", "b"):
        assert conditions(listener_entry(t, name))["Conflicted"] == ("True", "ProtocolConflict")
    assert conditions(listener_entry(t, "a"))["Accepted"] == ("False", "ProtocolConflict")
    assert conditions(listener_entry(t, "c"))["Conflicted"] == ("False", "NoConflicts")
    assert set(snapshot_resources(t.snapshots[GW], LISTENER_TYPE)) == {"http-81"}


def test_hostname_conflict_and_distinct_hostnames_sharing_a_port() -> None:
    t = run(
        gateways=(
            gateway(
                listeners=[
                    listener("a", hostname="a.example.com", from_="All"),
                    listener("b", hostname="a.example.com", from_="All"),
                    listener("c", hostname="c.example.com", from_="All"),
                    listener("d", from_="All"),
                ]
            ),
        )
    )
    for name in ("a", "b"):
        assert conditions(listener_entry(t, name))["Conflicted"] == ("True", "HostnameConflict")
    for name in ("c", "d"):
        assert conditions(listener_entry(t, name))["Accepted"] == ("True", "Accepted")
    resources = t.snapshots[GW].resources
    assert len(resources[LISTENER_TYPE]) == 1 and len(resources[ROUTE_TYPE]) == 1


def test_invalid_route_kinds() -> None:
    only_bad = listener("bad", kinds=[{"group": "gateway.networking.k8s.io", "kind": "TLSRoute"}])
    mixed = listener(
        "mixed",
        port=81,
        kinds=[
            {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"},
            {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute"},
        ],
    )
    t = run(gateways=(gateway(listeners=[only_bad, mixed]),), http_routes=())
    bad, mix = listener_entry(t, "bad"), listener_entry(t, "mixed")
    assert bad["supportedKinds"] == []
    assert conditions(bad)["ResolvedRefs"] == ("False", "InvalidRouteKinds")
    assert mix["supportedKinds"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}]
    assert conditions(mix)["ResolvedRefs"] == ("False", "InvalidRouteKinds")
    assert conditions(mix)["Accepted"] == ("True", "Accepted")


def test_static_addresses_are_unsupported() -> None:
    t = run(gateways=(gateway(addresses=[{"type": "IPAddress", "value": "10.1.1.1"}]),))
    assert conditions(t.gateway_status[GW]) == {
        "Accepted": ("False", "UnsupportedAddress"),
        "Programmed": ("False", "Invalid"),
    }
    assert GW not in t.snapshots


def test_programmed_follows_the_operator_and_addresses_are_typed() -> None:
    t = run(gateway_programmed={}, gateway_addresses={GW: ("gw.example.com", "10.0.0.1")})
    assert conditions(t.gateway_status[GW])["Programmed"] == ("False", "Pending")
    assert conditions(listener_entry(t, "http"))["Programmed"] == ("False", "Pending")
    assert t.gateway_status[GW]["addresses"] == [
        {"type": "Hostname", "value": "gw.example.com"},
        {"type": "IPAddress", "value": "10.0.0.1"},
    ]
    assert GW in t.snapshots  # accepted: Envoy gets its config before it is programmed


def test_transition_times_move_only_when_a_status_flips() -> None:
    first = run()
    gw = gateway(generation=2)
    gw["status"] = first.gateway_status[GW]
    later = "2025-02-01T00:00:00Z"
    second = translate(world(gateways=(gw,)), TranslateOptions(now=later))
    status = second.gateway_status[GW]
    assert {c["lastTransitionTime"] for c in status["conditions"]} == {NOW}
    assert {c["observedGeneration"] for c in status["conditions"]} == {2}
    gw["status"] = status
    third = translate(world(gateways=(gw,), gateway_programmed={}), TranslateOptions(now=later))
    times = {c["type"]: c["lastTransitionTime"] for c in third.gateway_status[GW]["conditions"]}
    assert times == {"Accepted": NOW, "Programmed": later}


def test_attached_routes_counts_accepted_routes_per_listener() -> None:
    t = run(
        gateways=(
            gateway(
                listeners=[
                    listener("a", from_="All"),
                    listener("b", port=81, from_="Same"),
                ]
            ),
        ),
        http_routes=(
            http_route("r1"),  # both listeners, but b only admits routes of the infra namespace
            http_route("r2", parents=[parent(section="a"), parent(section="a", port=80)]),
            http_route("r3", namespace=INFRA, parents=[parent(section="b")]),
        ),
    )
    assert listener_entry(t, "a")["attachedRoutes"] == 2
    assert listener_entry(t, "b")["attachedRoutes"] == 1
    assert (APPS, "r1") in t.route_parents


def test_each_port_gets_its_listener_and_route_table() -> None:
    t = run(
        gateways=(
            gateway(listeners=[listener(from_="All"), listener("alt", port=8080, from_="All")]),
        )
    )
    listeners = snapshot_resources(t.snapshots[GW], LISTENER_TYPE)
    assert set(listeners) == {"http-80", "http-8080"}
    hcm = listeners["http-8080"]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["rds"] == {
        "config_source": {"ads": {}, "resource_api_version": "V3"},
        "route_config_name": "http-8080",
    }
    assert listeners["http-8080"]["address"]["socket_address"] == {
        "address": "0.0.0.0",
        "port_value": 8080,
    }
    assert set(snapshot_resources(t.snapshots[GW], ROUTE_TYPE)) == {"http-80", "http-8080"}


def test_listeners_do_not_change_when_routes_do() -> None:
    """Route edits are RDS updates only: the LDS resources stay byte-identical."""
    a = run()
    b = run(http_routes=(http_route("only", rules=[]),))
    assert a.snapshots[GW].resources[LISTENER_TYPE] == b.snapshots[GW].resources[LISTENER_TYPE]
    assert a.snapshots[GW].version(LISTENER_TYPE) == b.snapshots[GW].version(LISTENER_TYPE)
    assert a.snapshots[GW].version(ROUTE_TYPE) != b.snapshots[GW].version(ROUTE_TYPE)


@pytest.mark.parametrize(
    "bad",
    [
        {"epp_health_check": "http"},
        {"pool_without_epp": "guess"},
        {"route_timeout_s": 0},
        {"fallback_retries": -1},
    ],
)
def test_bad_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TranslateOptions(**bad)
