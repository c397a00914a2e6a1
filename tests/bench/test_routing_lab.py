"""``infergate bench routing``: the lab runs real routers over real simulated fleets and
writes what it measured; bad choices are refused with a reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from infergate.bench.datasets import Tokens
from infergate.bench.routing.routers import ROUTERS, resolve
from infergate.bench.routing.sessions import sessions_of
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
    # Per request, in the workload's order, so two routers' files pair up request by request.
    files = [out / f"requests-tight-prefix-8-{name}.json" for name in rows]
    per_request = [json.loads(path.read_text()) for path in files]
    for requests in per_request:
        assert len(requests["ttft_s"]) == len(requests["prompt_tokens"]) == 24
        assert all(t > 0 for t in requests["ttft_s"]) and not any(requests["error"])
    assert per_request[0]["prompt_tokens"] == per_request[1]["prompt_tokens"]
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
    cells = _run(infergate_cli, "--cells", "1")
    assert cells.returncode == 2 and "--cells needs --matrix" in cells.stderr
    both = _run(infergate_cli, "--matrix", "core", "--rates", "5")
    assert both.returncode == 2 and "each matrix cell sets its own rate" in both.stderr
    outside = _run(infergate_cli, "--matrix", "core", "--cells", "16")
    assert outside.returncode == 2 and "outside 0-15" in outside.stderr


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
        "multi-turn-responses",
        "multi-turn-chat-sessions",
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


def test_matrix_cells_span_the_axes_and_size_their_fleet() -> None:
    from infergate.bench.routing import matrix

    cells = [c for c in matrix.select("standard", None) if isinstance(c, matrix.Cell)]
    assert len(cells) == len(matrix.select("standard", None))  # the synthetic family only
    assert {c.working_set for c in cells} >= {0.5, 1.0, 1.5, 2.5}
    assert {c.load for c in cells} >= {0.3, 0.6, 0.9, 1.1}
    assert {c.popularity for c in cells} == {"uniform", "zipf"}
    assert {c.engines for c in cells} == {4, 8} and any(c.adapters for c in cells)
    assert any(c.turns > 1 for c in cells) and any(c.mix == "mixed" for c in cells)
    assert len(matrix.select("core", None)) == 16
    assert [c.name for c in matrix.select("core", "0-1,15")] == [
        "ws0.5-load0.3", "ws0.5-load0.6", "ws2.5-load1.1",
    ]  # fmt: skip
    # The working set is the groups' prefixes over the fleet's KV tokens.
    wide = matrix.Cell(working_set=2.5)
    fleet_tokens = wide.engines * matrix.KV_BLOCKS * matrix.BLOCK_SIZE
    assert wide.groups * matrix.PREFIX_TOKENS == pytest.approx(2.5 * fleet_tokens, rel=0.05)
    # Round robin saturates sooner when fewer prefixes stay cached, later with more engines.
    assert matrix.saturation_rate(matrix.Cell(working_set=0.5)) > matrix.saturation_rate(wide)
    # (8 engines hold 26 groups where 4 hold 13: the rounding moves the hit rate a little.)
    assert matrix.saturation_rate(matrix.Cell(engines=8)) == pytest.approx(
        2 * matrix.saturation_rate(matrix.Cell()), rel=0.1
    )
    work = matrix.workload(matrix.Cell(working_set=1.0, load=0.6, adapters=8))
    assert work.kv_blocks == matrix.KV_BLOCKS and work.lora == 8 and work.engines == 4
    assert work.rates[0] == pytest.approx(0.6 * matrix.saturation_rate(matrix.Cell()), abs=0.1)
    for bad in ("core:1", "99"):
        with pytest.raises(ValueError, match="--cells"):
            matrix.select("core", bad)
    with pytest.raises(ValueError, match="unknown matrix"):
        matrix.select("huge", None)


def test_matrix_samples_follow_popularity_mix_turns_and_adapters() -> None:
    from infergate.bench.routing import matrix

    tokens = Tokens(None)
    zipf = matrix.build_samples(matrix.Cell(popularity="zipf"), tokens, 400, 3)
    groups = [s.group for s in zipf]
    assert groups.count(0) > 3 * groups.count(12)  # Zipf: the head group is far hotter
    mixed = matrix.build_samples(matrix.Cell(mix="mixed"), tokens, 200, 3)
    assert min(s.output_len for s in mixed) < 20 and max(s.output_len for s in mixed) > 150
    turns = matrix.build_samples(matrix.Cell(turns=3), tokens, 60, 3)
    session = [s for s in turns if s.group == turns[0].group]
    # Every turn carries the system prompt and the earlier turns, until the session ends.
    assert [len(s.messages or []) for s in session[:3]] == [2, 4, 6]
    assert len(session[3].messages or []) == 2
    lora = matrix.build_samples(matrix.Cell(adapters=4), tokens, 50, 3)
    assert all(s.group is not None and s.model == f"lora-{s.group % 4}" for s in lora)


def test_regret_divides_by_the_best_router_in_each_cell() -> None:
    from infergate.bench.routing.lab import RunResult
    from infergate.bench.routing.report import regret_markdown, regrets

    def row(cell: str, router: str, p90: float, p99: float) -> RunResult:
        return RunResult(cell, router, 1.0, completed=10, ttft_p90_ms=p90, ttft_p99_ms=p99)

    results = [
        row("a", "round-robin", 100, 200), row("a", "least-request", 120, 180),
        row("a", "epp", 90, 300),
        row("b", "round-robin", 400, 800), row("b", "least-request", 500, 900),
        row("b", "epp", 200, 400),
        row("c", "round-robin", 10, 10),  # not every router ran: left out
    ]  # fmt: skip
    by = {g.router: g for g in regrets(results)}
    assert by["epp"].cells == 2
    assert by["epp"].p90_worst == pytest.approx(1.0) and by["epp"].p99_worst == pytest.approx(
        300 / 180
    )
    assert by["round-robin"].p90_mean == pytest.approx((100 / 90 + 400 / 200) / 2)
    # Against the better of round robin and least request in each cell.
    assert by["epp"].p90_vs_baseline == pytest.approx(0.9)
    assert by["epp"].p99_vs_baseline == pytest.approx(300 / 180)
    assert "| epp | 2 |" in regret_markdown(list(by.values()))


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

    with pytest.raises(routers.RouterUnavailable, match=r"tools/peers/build_llmd_epp.sh SNAPSHOT"):
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


def test_regret_combines_matrix_parts(infergate_cli: list[str], tmp_path: Path) -> None:
    from infergate.bench.routing.lab import RunResult
    from infergate.bench.routing.report import write_json

    def row(cell: str, router: str, p90: float) -> RunResult:
        return RunResult(cell, router, 1.0, completed=10, ttft_p90_ms=p90, ttft_p99_ms=2 * p90)

    write_json([row("a", "round-robin", 100), row("a", "epp", 50)], tmp_path / "1.json", {})
    write_json([row("b", "round-robin", 100), row("b", "epp", 200)], tmp_path / "2.json", {})
    done = subprocess.run(
        [*infergate_cli, "bench", "regret", str(tmp_path / "1.json"), str(tmp_path / "2.json"),
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # epp: best in a (1.00), twice the best in b (2.00): worst 2.00, mean 1.50.
    assert "| epp | 2 | 2.00 | 1.50 |" in done.stdout
    assert (tmp_path / "routing-regret.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text("{}")
    bad = subprocess.run(
        [*infergate_cli, "bench", "regret", str(tmp_path / "bad.json")],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "400"},  # the error box must not wrap the message
    )  # fmt: skip
    assert bad.returncode == 2 and "not a routing-lab results.json" in bad.stderr


def test_session_workloads_send_the_same_sessions_through_two_apis() -> None:
    chat, responses = WORKLOADS["multi-turn-chat-sessions"], WORKLOADS["multi-turn-responses"]
    assert (chat.session_api, responses.session_api) == ("chat", "responses")
    a, b = chat.build(Tokens(None), 16, 3), responses.build(Tokens(None), 16, 3)
    assert [(s.prompt, s.system, s.group) for s in a] == [(s.prompt, s.system, s.group) for s in b]
    sessions = sessions_of(a)
    assert [len(turns) for turns in sessions] == [8, 8]
    assert len({turn.system for turn in sessions[0]}) == 1  # one system prompt per session
    assert sessions[0][0].system != sessions[1][0].system


def test_responses_sessions_land_on_their_holder_through_the_epp(
    infergate_cli: list[str], tmp_path: Path
) -> None:
    """Through the EPP every follow-up turn reaches the engine holding its conversation;
    round robin sends some elsewhere, where the engine has no such response (404)."""
    out = tmp_path / "lab"
    result = _run(
        infergate_cli,
        "--workload", "multi-turn-responses",
        "--router", "round-robin",
        "--router", "epp-infergate",
        "--engines", "2",
        "--num-prompts", "24",
        "--rates", "8",
        "--output-len", "4",
        "--seed", "5",
        "--output-dir", str(out),
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["router"]: row for row in json.loads((out / "results.json").read_text())["results"]}
    follow_ups = 3 * 7  # 3 sessions of 8 turns
    epp, rr = rows["epp-infergate"], rows["round-robin"]
    assert epp["failed"] == 0 and epp["completed"] == 24
    assert epp["follow_ups_on_holder"] == 1.0
    # Under round robin a follow-up fails exactly when it missed its holder.
    missed = round(follow_ups * (1.0 - rr["follow_ups_on_holder"]))
    assert rr["failed"] == missed and rr["completed"] == 24 - missed
    assert "on holder" in result.stdout


def test_bad_epp_replica_counts_are_refused(infergate_cli: list[str]) -> None:
    word = _run(infergate_cli, "--epp-replicas", "1,four")
    assert word.returncode == 2 and "'four' is not a whole number" in word.stderr
    zero = _run(infergate_cli, "--epp-replicas", "0")
    assert zero.returncode == 2 and "0 is not between 1 and 16" in zero.stderr


def test_failures_before_an_engine_are_read_from_envoys_access_log(tmp_path: Path) -> None:
    from infergate.bench.routing.lab import _failed_before_engine

    log = tmp_path / "envoy.log"
    log.write_text(
        '[t] "POST /v1/completions" 200 - picked=a:1 upstream=a:1 duration_ms=5 upstream_ms=4\n'
        '[t] "POST /v1/completions" 500 - picked=a:1 upstream=a:1 duration_ms=5 upstream_ms=-\n'
        '[t] "POST /v1/completions" 500 UF picked=- upstream=- duration_ms=1 upstream_ms=-\n'
        '[t] "POST /v1/completions" 0 DC picked=- upstream=- duration_ms=1 upstream_ms=-\n'
        '[t] "POST /v1/completions" 429 - picked=- upstream=- duration_ms=1 upstream_ms=-\n'
        "[2026] envoy log line without an access record\n"
    )
    assert _failed_before_engine(log) == 2
