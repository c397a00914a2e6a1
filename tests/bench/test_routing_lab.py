"""``infergate bench routing``: the lab runs real routers over real simulated fleets and
writes what it measured; bad choices are refused with a reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from infergate.bench.datasets import Tokens
from infergate.bench.routing.routers import ROUTERS, resolve
from infergate.bench.routing.workloads import WORKLOADS


def _run(infergate_cli: list[str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*infergate_cli, "bench", "routing", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_lab_compares_routers_on_fresh_fleets(infergate_cli: list[str], tmp_path: Path) -> None:
    out = tmp_path / "lab"
    result = _run(
        infergate_cli,
        "--workload", "tight-prefix",
        "--router", "round-robin",
        "--router", "epp-infergate",
        "--engines", "2",
        "--num-prompts", "24",
        "--rates", "8",
        "--output-len", "4",
        "--output-dir", str(out),
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "results.json").read_text())
    rows = {row["router"]: row for row in data["results"]}
    assert set(rows) == {"round-robin", "epp-infergate"}
    for row in rows.values():
        assert row["completed"] == 24 and row["failed"] == 0
        assert sum(row["per_engine_requests"]) == 24  # the engines' own counters
        assert 0.0 <= row["prefix_hit_rate"] <= 1.0 and row["ttft_p90_ms"] > 0
    # Round robin splits evenly by construction; its imbalance is the ideal 1.0.
    assert rows["round-robin"]["imbalance"] == 1.0
    # The EPP's own view is kept for a person to read: what it learned about each engine.
    (epp_metrics,) = out.glob("epp-metrics-tight-prefix-8-epp-infergate.txt")
    assert "infergate_epp_endpoint_prefill_seconds_per_token" in epp_metrics.read_text()
    assert (out / "routing-tight-prefix.png").stat().st_size > 0
    assert "TTFT p90" in result.stdout


def test_bad_choices_are_refused(infergate_cli: list[str], tmp_path: Path) -> None:
    unknown = _run(infergate_cli, "--workload", "nope")
    assert unknown.returncode == 2 and "unknown workload 'nope'" in unknown.stderr
    router = _run(infergate_cli, "--router", "nginx")
    assert router.returncode == 2 and "unknown router 'nginx'" in router.stderr
    missing = _run(infergate_cli, "--router", f"epp:{tmp_path / 'none.yaml'}")
    assert missing.returncode == 2 and "no EndpointPickerConfig file" in missing.stderr
    rates = _run(infergate_cli, "--rates", "fast")
    assert rates.returncode == 2


def test_presets_cover_the_questions_users_ask() -> None:
    assert set(WORKLOADS) == {
        "tight-prefix",
        "ample-prefix",
        "no-sharing",
        "multi-turn",
        "long-short",
        "bursty",
        "heterogeneous",
        "many-adapters",
    }
    assert set(ROUTERS) >= {
        "round-robin",
        "least-request",
        "sglang-cache-aware",
        "epp-gie",
        "epp-infergate",
        "epp-lora",
    }
    adapters = WORKLOADS["many-adapters"]
    picks = [s.model for s in adapters.build(Tokens(None), 400, 0)]
    assert set(picks) <= {f"lora-{k}" for k in range(16)} and len(set(picks)) > 10
    assert picks.count("lora-0") > 3 * picks.count("lora-15")  # a few popular adapters
    assert (adapters.lora, adapters.max_loras) == (16, 4)
    assert resolve("epp:builtin:gie-default").name == "epp:builtin:gie-default"
    samples = WORKLOADS["multi-turn"].build(Tokens(None), 16, 0)
    # Two sessions of 8 turns; turn k carries the system prompt and every earlier turn.
    session = [s for s in samples if s.group == 0]
    assert [len(s.messages or []) for s in session] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert (session[3].messages or [])[:6] == session[2].messages  # the prefix grows


def test_sglang_router_missing_is_a_clear_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    from infergate.bench.routing import routers

    monkeypatch.setattr(routers, "sglang_available", lambda: False)
    with pytest.raises(routers.RouterUnavailable, match="pip install sglang-router"):
        routers.ROUTERS["sglang-cache-aware"].start(None)  # type: ignore[arg-type]


def test_external_epp_gets_the_peers_default_profile_and_the_labs_fleet(tmp_path: Path) -> None:
    """What the lab hands an external EPP: llm-d-router's default weights, file discovery
    of the lab's engines (any discovery of the user's replaced), plaintext on free ports."""
    from infergate.bench.routing import external

    endpoints = tmp_path / "endpoints.yaml"
    config = external.with_file_discovery(external.load_config(None), endpoints)
    (profile,) = config["schedulingProfiles"]
    weights = {ref["pluginRef"]: ref["weight"] for ref in profile["plugins"]}
    assert weights == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
    }
    discovery = config["dataLayer"]["discovery"]["pluginRef"]
    (plugin,) = [p for p in config["plugins"] if p["name"] == discovery]
    assert plugin["type"] == "file-discovery"
    assert plugin["parameters"] == {"path": str(endpoints), "watchFile": False}
    assert external.PEER_DEFAULT_CONFIG["plugins"][-1]["type"] == "prefix-cache-scorer"  # untouched

    user = tmp_path / "mine.yaml"
    user.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- {name: q, type: queue-scorer}\n"
        "- {name: theirs, type: file-discovery, parameters: {path: /etc/epp/endpoints.yaml}}\n"
        "schedulingProfiles:\n- {name: default, plugins: [{pluginRef: q}]}\n"
        "dataLayer: {discovery: {pluginRef: theirs}}\n"
    )
    mine = external.with_file_discovery(external.load_config(user), endpoints)
    assert [p["name"] for p in mine["plugins"]] == ["q", external.DISCOVERY_PLUGIN]
    assert mine["dataLayer"]["discovery"] == {"pluginRef": external.DISCOVERY_PLUGIN}

    document = external.endpoints_document(["127.0.0.1:8001", "127.0.0.1:8002"])
    assert document["endpoints"][1] == {"name": "engine-1", "address": "127.0.0.1", "port": "8002"}
    argv = external.epp_argv(
        Path("/bin/epp"), tmp_path / "c.yaml", grpc_port=1, health_port=2, metrics_port=3
    )
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == "/bin/epp" and flags["--config-file"] == str(tmp_path / "c.yaml")
    assert (flags["--grpc-port"], flags["--grpc-health-port"], flags["--metrics-port"]) == (
        "1",
        "2",
        "3",
    )
    assert "--secure-serving=false" in argv


def test_external_epp_bad_config_is_refused(tmp_path: Path) -> None:
    from infergate.bench.routing import external

    with pytest.raises(ValueError, match="No such file"):
        resolve("external-epp", external_epp_config=tmp_path / "none.yaml")
    not_epc = tmp_path / "envoy.yaml"
    not_epc.write_text("static_resources: {}\n")
    with pytest.raises(external.ExternalEppError, match="not an EndpointPickerConfig"):
        resolve("external-epp", external_epp_config=not_epc)
    no_profile = tmp_path / "bare.yaml"
    no_profile.write_text("kind: EndpointPickerConfig\nplugins: []\n")
    with pytest.raises(external.ExternalEppError, match="no schedulingProfiles"):
        external.load_config(no_profile)
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [\n")
    with pytest.raises(external.ExternalEppError, match="not YAML"):
        external.load_config(broken)


def test_external_epp_without_a_binary_is_a_clear_skip(tmp_path: Path) -> None:
    """No binary (or not an executable one): skipped before anything starts, saying how
    to build the peer."""
    from infergate.bench.routing import routers

    with pytest.raises(routers.RouterUnavailable, match=r"go build .*cmd/epp"):
        resolve("external-epp").start(None)  # type: ignore[arg-type]
    text = tmp_path / "epp"
    text.write_text("not a program")
    with pytest.raises(routers.RouterUnavailable, match="is not an executable file"):
        resolve("external-epp", external_epp=text).start(None)  # type: ignore[arg-type]


def test_cli_external_epp_with_a_bad_config_exits_2(
    infergate_cli: list[str], tmp_path: Path
) -> None:
    result = _run(
        infergate_cli, "--router", "external-epp", "--external-epp-config", str(tmp_path / "x.yaml")
    )
    assert result.returncode == 2 and "--external-epp-config" in result.stderr
