"""``infergate up`` supervision: a SIGKILLed engine is reported and restarted while the
EPP and Envoy keep serving, through the real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model
from infergate.stack.supervise import EngineSupervisor


def _completion(stack: LocalStack) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/completions",
        json={"model": stack.model_name, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )


def _served_within(stack: LocalStack, seconds: float) -> list[int]:
    """Statuses of completions sent until one is a 200; AssertionError after ``seconds``."""
    statuses: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        statuses.append(_completion(stack).status_code)
        if statuses[-1] == 200:
            return statuses
        time.sleep(0.2)
    raise AssertionError(f"the stack served nothing in {seconds} s: {statuses}")


def test_dead_engine_is_reported_and_restarted_while_the_stack_serves(tmp_path: Path) -> None:
    spec = StackSpec.on_free_ports(
        engines=2,
        model=ensure_tiny_model(),
        simulate=True,
        access_log=False,
        workdir=tmp_path,
        start_timeout=180.0,
    )
    with LocalStack(spec) as stack:
        reports: list[str] = []
        supervisor = EngineSupervisor(stack, reports.append)
        victim = stack.engines[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.popen.wait(10)  # type: ignore[union-attr]
        supervisor.check()
        assert reports and "engine-0 exited" in reports[0]
        assert supervisor.restarts == [1, 0]
        assert stack.engines[0] is not victim
        # The rest keeps serving meanwhile, and the restarted engine comes back. The first
        # request after the kill got a 503 once in five full-suite runs, with the machine
        # loaded; the cause was not found. It never recurred when this test ran alone, or
        # under a CPU hog. Serving within seconds, with no restart of the EPP or Envoy, is
        # what this asserts.
        assert _served_within(stack, 10.0)[-1] == 200
        assert stack.epp is not None and stack.envoy is not None
        assert stack.epp.alive() and stack.envoy.alive()
        port = spec.resolved_engine_ports()[0]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            supervisor.check()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("engine-0 did not come back")
        assert supervisor.restarts == [1, 0]
        assert all(_completion(stack).status_code == 200 for _ in range(4))
