"""Engine-side priority through real `engine serve` processes.

With ``--scheduling-policy priority`` and one running slot, requests queue in the engine;
the order of their first tokens is the order the scheduler admitted them. The body's
``priority`` and the EPP's ``x-infergate-priority`` header both set it (the body wins);
the EPP's ``x-infergate-order-delay`` moves a request back within its priority.
Under fcfs (the shared simulated server) a non-zero body priority is a 400, as in vLLM.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infergate.procs import ProcessGroup

from .conftest import MODEL, Server, _start

HEADER = "x-infergate-priority"
DELAY = "x-infergate-order-delay"


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Server]:
    """Simulated engine, priority policy, one sequence at a time (so requests queue)."""
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-sim-priority", tiny_model_dir,
            "--simulate", "--max-model-len", "1024", "--scheduling-policy", "priority",
            "--max-num-seqs", "1",
        )  # fmt: skip


def _first_token_times(
    server: Server, calls: list[tuple[str, dict[str, Any], dict[str, str]]]
) -> dict[str, float]:
    """Send ``calls`` (name, extra body, headers) in order, each once the engine holds
    the earlier ones; the time of each stream's first token, by name.

    The first call holds the only running slot until every call is queued: its client
    then goes away, which aborts it, so the queue's order alone decides what follows
    (however slowly a loaded machine queues the calls).
    """
    times: dict[str, float] = {}
    errors: list[BaseException] = []
    all_queued = threading.Event()

    def one(name: str, extra: dict[str, Any], headers: dict[str, str], hold: bool) -> None:
        body = {"model": MODEL, "prompt": f"request {name}", "stream": True,
                "max_tokens": 1000 if hold else 30, **extra}  # fmt: skip
        try:
            with (
                server.http() as http,
                http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
            ):
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if name not in times and line.startswith("data: ") and '"text"' in line:
                        times[name] = time.monotonic()
                    if hold and all_queued.is_set():
                        break  # leaving the stream aborts the request
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = []
    for k, (name, extra, headers) in enumerate(calls):
        thread = threading.Thread(target=one, args=(name, extra, headers, k == 0))
        thread.start()
        threads.append(thread)
        _wait_held(server, k + 1, errors)
    all_queued.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return times


def _wait_held(server: Server, count: int, errors: list[BaseException]) -> None:
    """Until the engine holds ``count`` requests (running + waiting)."""
    deadline = time.monotonic() + 30
    while True:
        assert not errors, errors
        metrics = server.metrics()
        held = sum(
            metrics[f"vllm:num_requests_{kind}{{model_name={MODEL}}}"]
            for kind in ("running", "waiting")
        )
        if held >= count:
            return
        assert time.monotonic() < deadline, f"engine holds {held}, expected {count}"
        time.sleep(0.01)


def test_a_late_important_request_runs_before_the_queued_background(
    priority_server: Server,
) -> None:
    priority_server.wait_idle()
    background: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        (f"bg{i}", {"priority": 5}, {}) for i in range(4)
    ]
    calls = [
        *background,
        ("header", {}, {HEADER: "-5"}),  # the EPP's hint, no body priority: -5
        ("body-wins", {"priority": 3}, {HEADER: "-100"}),  # the body's 3, not -100
        ("urgent", {"priority": -10}, {}),
    ]
    times = _first_token_times(priority_server, calls)
    order = sorted(times, key=times.__getitem__)
    # bg0 held the only slot while the others arrived; the rest run by priority, the
    # background (equal priority) in arrival order.
    assert order == ["bg0", "urgent", "header", "body-wins", "bg1", "bg2", "bg3"]


def test_an_order_delay_lets_a_short_prefill_overtake_within_its_priority(
    priority_server: Server,
) -> None:
    """The EPP sends ``x-infergate-order-delay`` = weight x predicted prefill: a long
    prompt queued first with a large delay waits behind later ones with small delays;
    a request without one keeps its arrival, so it goes before a delayed one that arrived
    less than the delay earlier (the calls here arrive well under 5 s apart); priority
    still comes first."""
    priority_server.wait_idle()
    calls: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("holder", {}, {}),
        ("long", {}, {DELAY: "600"}),  # arrival + 600 s
        ("short", {}, {DELAY: "5"}),  # arrival + 5 s: before long, after none
        ("none", {}, {}),  # no header: its arrival
        ("background", {"priority": 1}, {DELAY: "0"}),  # a later priority: last
    ]
    times = _first_token_times(priority_server, calls)
    order = sorted(times, key=times.__getitem__)
    assert order == ["holder", "none", "short", "long", "background"]


def test_priority_values_are_checked(priority_server: Server, sim_server: Server) -> None:
    def status(server: Server, extra: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1, **extra}
        with server.http() as http:
            response = http.post("/v1/completions", json=body, headers=headers or {})
        param = response.json().get("error", {}).get("param") if response.is_error else None
        return response.status_code, param

    top, bottom = 2**63 - 1, -(2**63)
    for server in (priority_server, sim_server):
        for bad in (2**63, -(2**63) - 1, "1", 1.5, True, None, [1]):
            assert status(server, {"priority": bad}) == (400, "priority"), bad
    for good in (top, bottom, 0, -1):
        assert status(priority_server, {"priority": good}) == (200, None), good
    for bad_header in ("high", "1.5", str(2**63), ""):
        assert status(priority_server, {}, {HEADER: bad_header}) == (400, HEADER), bad_header
    for bad_delay in ("-1", "3601", "nan", "inf", "soon", ""):
        assert status(priority_server, {}, {DELAY: bad_delay}) == (400, DELAY), bad_delay
    for good_delay in ("0", "0.25", "3600"):
        assert status(priority_server, {}, {DELAY: good_delay}) == (200, None), good_delay
    # fcfs: vLLM's refusal of a non-zero priority; the gateway's header is ignored there.
    assert status(sim_server, {"priority": 1}) == (400, "priority")
    assert status(sim_server, {"priority": 0}) == (200, None)
    assert status(sim_server, {}, {HEADER: "-7"}) == (200, None)
    assert status(sim_server, {}, {HEADER: "garbage"}) == (200, None)
    assert status(sim_server, {}, {DELAY: "garbage"}) == (200, None)
    # Chat completions read the same field.
    with sim_server.http() as http:
        chat = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "priority": 2,
        })  # fmt: skip
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "priority"
    with priority_server.http() as http:
        chat = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "priority": -2,
        })  # fmt: skip
    assert chat.status_code == 200


def test_unknown_scheduling_policy_is_one_clear_line(
    tiny_model_dir: Path, infergate_cli: list[str]
) -> None:
    import subprocess

    result = subprocess.run(
        [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--simulate",
         "--scheduling-policy", "lifo"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--scheduling-policy lifo: choose one of fcfs, priority" in result.stderr
