"""Trace replay in the routing lab: the Mooncake format read (and refused with the line
number), windows chosen by seed, prompts built from block ids at exact token lengths,
the named GPU timing profile's numbers, and a short real lab run on a tiny trace."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from infergate.engine.interfaces import ScheduledBatch, ScheduledSeq
from infergate.engine.sim_runner import PROFILES, TimingModel

from infergate.bench.datasets import Tokens
from infergate.bench.routing import traces
from infergate.bench.routing.lab import RunResult
from infergate.bench.routing.report import LAG_SPREAD_BOUND, faithfulness
from infergate.bench.routing.traces import BlockText, Replay, TraceError, TraceRequest
from infergate.stack.local import ensure_tiny_model


def _line(ts: float, inp: int, out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


def _tiny_trace(path: Path) -> Path:
    """16 requests over 8 s: three groups sharing 3 blocks, each with 2 blocks of its own."""
    lines = []
    for k in range(16):
        ids = [100 + (k % 3) * 10 + i for i in range(3)] + [1000 + 2 * k, 1001 + 2 * k]
        lines.append(_line(k * 500, 4 * 512 + 1 + 37 * k % 511, 4 + k % 9, ids))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_lines_are_read_in_time_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(900, 600, 5, [1, 2]) + "\n\n" + _line(100, 512, 0, [1]) + "\n")
    first, second = traces.read_trace(path)
    assert first == TraceRequest(100.0, 512, 0, (1,))
    assert second.timestamp_ms == 900 and second.hash_ids == (1, 2)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (_line(-1, 512, 1, [1]), "'timestamp'"),
        (_line(0, 0, 1, []), "'input_length'"),
        (json.dumps({"timestamp": 0, "input_length": 512, "hash_ids": [1]}), "'output_length'"),
        (_line(0, 512, 1, [1, 2]), "2 hash_ids for 512 input tokens"),
        (_line(0, 513, 1, [1]), "1 hash_ids for 513 input tokens"),
        (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}),
         "'hash_ids'"),
    ],
)  # fmt: skip
def test_a_malformed_line_is_refused_with_its_number(tmp_path: Path, bad: str, says: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(0, 512, 1, [1]) + "\n" + bad + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{says}"):
        traces.read_trace(path)


def test_the_cli_refuses_a_malformed_trace_before_starting_a_fleet(
    infergate_cli: list[str], tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(0, 512, 1, [1]) + "\n" + _line(1, 512, 1, [1, 2]) + "\n")
    result = subprocess.run(
        [*infergate_cli, "bench", "routing", "--trace", str(path), "--trace-window", "0:1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "t.jsonl:2:" in " ".join(result.stderr.split())


def test_windows_by_seed_are_deterministic_and_inside_the_trace() -> None:
    trace = [TraceRequest(t * 1000.0, 512, 1, (t,)) for t in range(600)]
    a = traces.window_for_seed(trace, 60, seed=3)
    assert a == traces.window_for_seed(trace, 60, seed=3) and a.seed == 3
    starts = {traces.window_for_seed(trace, 60, seed=s).start_s for s in range(8)}
    assert len(starts) == 8 and all(0 <= s <= 599 - 60 for s in starts)
    chosen = traces.in_window(trace, a)
    assert len(chosen) == 60 and chosen[0].timestamp_ms >= a.start_s * 1000
    assert traces.parse_windows(["12.5:30"]) == [traces.Window(12.5, 30.0)]
    for bad in ("12", "x:3", "5:0", "-1:5"):
        with pytest.raises(ValueError, match="START:SECONDS"):
            traces.parse_windows([bad])


def test_windows_by_seed_start_at_the_first_request_of_a_trace_cut_from_a_longer_one() -> None:
    """A slice of a trace keeps its timestamps: here 20 minutes in. Every seed's window
    must fall among its requests, not in the empty 20 minutes before them."""
    trace = [TraceRequest((1200 + t) * 1000.0, 512, 1, (t,)) for t in range(150)]
    for seed in range(16):
        window = traces.window_for_seed(trace, 60, seed=seed)
        assert 1200 <= window.start_s <= 1200 + 149 - 60
        assert len(traces.in_window(trace, window)) == 60
    whole = traces.window_for_seed(trace, 600, seed=1)  # longer than the trace: all of it
    assert whole.start_s == 1200 and len(traces.in_window(trace, whole)) == 150


def test_equal_block_ids_give_equal_tokens_at_exact_lengths() -> None:
    tokens = Tokens(ensure_tiny_model())
    assert tokens.tokenizer is not None
    text = BlockText(tokens)
    a = text.prompt([7, 8, 9], 2 * 512 + 100)
    b = text.prompt([7, 8, 10], 2 * 512 + 300)
    ids_a = tokens.tokenizer.encode(a, add_special_tokens=False).ids
    ids_b = tokens.tokenizer.encode(b, add_special_tokens=False).ids
    assert (len(ids_a), len(ids_b)) == (1124, 1324)
    assert ids_a[:1024] == ids_b[:1024]  # the shared blocks 7 and 8
    assert ids_a[1024:1124] != ids_b[1024:1124]  # blocks 9 and 10 differ
    assert tokens.count(text.prompt([9], 512)) == 512
    assert text.prompt([7], 512) == BlockText(tokens).prompt([7], 512)  # by id, not by order
    # Without a tokenizer the lab counts words: one word per token there too.
    assert len(BlockText(Tokens(None)).prompt([1, 2], 700).split()) == 700


def test_scale_keeps_whole_blocks_and_caps_output_before_scaling() -> None:
    request = TraceRequest(0, 3 * 512 + 10, 400, (1, 2, 3, 4))
    assert Replay().lengths(request) == (1546, 400)
    assert Replay(scale=0.125, max_output=100).lengths(request) == (3 * 64 + 2, 12)
    for bad in (0.3, 0.0, 2.0):
        with pytest.raises(ValueError, match="whole number"):
            traces._scale(bad)


def test_prefix_ceiling_counts_blocks_seen_before() -> None:
    requests = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1024, 1, (1, 3))]
    assert traces.prefix_ceiling(requests) == 0.25


def _seq(n: int, start: int = 0) -> ScheduledSeq:
    return ScheduledSeq("r", [1] * n, start, [], sample=True)


def test_h100_profile_follows_its_roofline() -> None:
    profile = PROFILES["h100-llama3.1-8b"]
    model = TimingModel(profile="h100-llama3.1-8b")
    flops = 0.55 * 989.4e12
    bandwidth = 0.8 * 3.35e12
    kv_per_token = 2 * 32 * 8 * 128 * 2
    assert kv_per_token == 128 * 1024 == profile.model.kv_bytes_per_token
    # Prefill: 2 x params FLOPs per token, plus 4 x layers x heads x head_dim per pair.
    n = 8192
    prefill = 2 * 8.03e9 / flops * n + 4 * 32 * 32 * 128 * n * (n + 1) / 2 / flops
    expected = prefill + n * kv_per_token / bandwidth + 15e-6
    assert model.step_seconds(ScheduledBatch([_seq(n)])) == pytest.approx(expected)
    # Decode: the weights once plus each sequence's KV, for a batch of 64 at 2k context.
    batch = ScheduledBatch([_seq(1, 2047) for _ in range(64)])
    decode = 2 * 8.03e9 / bandwidth + 64 * 2048 * kv_per_token / bandwidth + 64 * 15e-6
    assert model.step_seconds(batch) == pytest.approx(decode)
    # KV capacity: 80 GiB x 0.9 less the weights and 2 GiB of activations, in blocks of 16.
    free = 80 * 2**30 * 0.9 - 2 * 8.03e9 - 2 * 2**30
    assert model.num_blocks(16) == int(free // kv_per_token) // 16
    # The A100 is slower at both.
    a100 = TimingModel(profile="a100-llama3.1-8b")
    assert a100.step_seconds(batch) > model.step_seconds(batch)


def test_token_scale_keeps_a_requests_modelled_time() -> None:
    """At scale F a prompt of n·F tokens costs what n tokens cost at full scale, and the
    KV cache holds F times as many blocks."""
    full = TimingModel(profile="h100-llama3.1-8b")
    eighth = TimingModel(profile="h100-llama3.1-8b", token_scale=0.125)
    big = full.step_seconds(ScheduledBatch([_seq(8192, 8192)]))
    small = eighth.step_seconds(ScheduledBatch([_seq(1024, 1024)]))
    assert small == pytest.approx(big, rel=1e-3)
    one_decode = ScheduledBatch([_seq(1, 100)])
    assert eighth.step_seconds(one_decode) > 7 * full.step_seconds(one_decode)
    assert eighth.num_blocks(16) == int(full.num_blocks(16) * 0.125)
    with pytest.raises(ValueError, match="unknown timing profile 'b200'"):
        TimingModel(profile="b200")


def test_a_comparison_with_one_late_row_names_it() -> None:
    rows = [
        RunResult("w", "round-robin", 4.0, completed=10, sim_lag=0.02),
        RunResult("w", "peer", 4.0, completed=10, sim_lag=0.02 + LAG_SPREAD_BOUND + 0.01),
        RunResult("w", "epp", 4.0, completed=10, sim_lag=0.03, send_lag_p99_ms=400.0),
        RunResult("other", "peer", 4.0, completed=10, sim_lag=0.5),  # alone: nothing to compare
    ]
    lines = faithfulness(rows)
    assert len(lines) == 2
    assert "late beside peer" in lines[0] and "round-robin" in lines[0]
    assert "sent epp's requests" in lines[1]


@pytest.mark.slow  # two fresh fleets: about 70 s on a busy 2-core machine
def test_a_tiny_trace_runs_through_two_routers(infergate_cli: list[str], tmp_path: Path) -> None:
    out = tmp_path / "lab"
    result = subprocess.run(
        [*infergate_cli, "bench", "routing", "--trace", str(_tiny_trace(tmp_path / "t.jsonl")),
         "--trace-window", "0:4", "--trace-speedup", "2", "--engines", "2",
         "--router", "round-robin", "--router", "least-request", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trace window 0s+4s (given): 8 requests" in result.stdout
    data = json.loads((out / "results.json").read_text())
    assert data["trace"]["gpu_profile"] == "h100-llama3.1-8b" and data["trace"]["scale"] == 1
    rows = data["results"]
    assert {r["router"] for r in rows} == {"round-robin", "least-request"}
    for row in rows:
        assert row["workload"] == "t@0s+4s" and row["completed"] == 8 and row["failed"] == 0
        assert row["send_lag_p99_ms"] >= 0 and row["prefix_hit_rate"] > 0
    per_request = json.loads((out / "requests-t@0s+4s-4-round-robin.json").read_text())
    expected = [Replay().lengths(r)[0] for r in traces.read_trace(tmp_path / "t.jsonl")[:8]]
    assert per_request["prompt_tokens"] == [n + 1 for n in expected]  # the engine's BOS
    assert len(per_request["send_lag_s"]) == 8
