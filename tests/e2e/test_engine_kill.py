"""Engine death costs no request sent after it (issue 45 item 8).

Real stack: three simulated engines, the EPP with its default profile, infergate's Envoy.
Clients keep requests flowing; one engine is SIGKILLed mid-run. Every request sent after
the kill must succeed (the EPP's view lags the kill, so some are still picked to the dead
engine: Envoy's retry takes the next endpoint of the EPP's list), and the EPP's in-flight
count for the dead engine must drop to zero once it is known dead, not when its
requests' completion records time out.

Also the benchmark of docs/benchmarks/resilience.md ("Engine SIGKILL under load"): ``INFERGATE_KILL_REQUESTS=450``
sets how many requests are sent after the kill (default 120); the outcome is printed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.stack.local import LocalStack, StackSpec

AFTER_KILL = int(os.environ.get("INFERGATE_KILL_REQUESTS", "120"))
CLIENTS = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=3,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        access_log=True,
        workdir=tmp_path_factory.mktemp("engine-kill"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def _in_flight(stack: LocalStack, endpoint: str) -> float:
    """The EPP's ``infergate_epp_endpoint_in_flight_requests`` for ``endpoint`` (0 if absent)."""
    for line in httpx.get(stack.epp_metrics_url, timeout=5).text.splitlines():
        if line.startswith("infergate_epp_endpoint_in_flight_requests") and endpoint in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class _Load:
    """Clients sending completions back to back; results split at the kill."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.killed_at = 0.0  # time.monotonic() of the kill (0: not yet)
        self.before: list[int] = []
        self.after: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.stack.base_url, timeout=120) as client:
            n = 0
            while True:
                with self.lock:
                    if self.killed_at and len(self.after) >= AFTER_KILL:
                        return
                sent_at = time.monotonic()
                body = {"model": "tiny", "prompt": f"client {index} request {n}", "max_tokens": 8}
                n += 1
                try:
                    reply = client.post("/v1/completions", json=body)
                    status, text = reply.status_code, reply.text[:200]
                except httpx.HTTPError as error:
                    status, text = 0, repr(error)
                with self.lock:
                    if self.killed_at and sent_at > self.killed_at:
                        self.after.append((status, text))
                    else:
                        self.before.append(status)


def test_no_request_sent_after_an_engine_kill_fails(stack: LocalStack) -> None:
    load = _Load(stack)
    for thread in load.threads:
        thread.start()
    while len(load.before) < 40:  # steady state, every engine busy
        time.sleep(0.05)
    victim = stack.engine_addresses[0]
    process = stack.engines[0]
    os.killpg(process.pid, signal.SIGKILL)
    with load.lock:
        load.killed_at = time.monotonic()
    for thread in load.threads:
        thread.join(timeout=600)
    failed = [(status, text) for status, text in load.after if status != 200]
    print(f"\nrequests sent after the kill: {len(load.after)}, failed: {len(failed)} {failed[:5]}")
    assert not failed
    # The dead engine's in-flight count is released once the EPP knows it is dead.
    deadline = time.monotonic() + 30
    while _in_flight(stack, victim) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(stack, victim) == 0
