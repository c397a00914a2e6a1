"""Several EPP replicas behind one Envoy agree on prefixes, and survive one's death.

Real processes: simulated engines on the tiny model publishing completion records, two
EPP replicas, a real Envoy whose ext_proc cluster has both. A request routed by one
replica reaches an engine, whose admission record carries the prompt's block hashes to
every replica; the replica that never saw the request must then score that prompt's
prefix as cached on that engine (asked directly over ext-proc, so nothing but the
records can have told it). Then one replica is SIGKILLed and every later request still
gets through Envoy (the next stream opens on the live replica), and the dead one is
restarted as ``infergate up`` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from infergate.envoy.bootstrap import UPSTREAM_HOST_HEADER
from infergate.stack.local import LocalStack, StackSpec
from infergate.stack.supervise import EppSupervisor

from ..epp.conftest import Stream, body, headers, set_headers

PROMPTS = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=2,
        epp_replicas=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        epp_args=["--scores-header"],
        access_log=True,
        workdir=tmp_path_factory.mktemp("epp-replicas"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as stack:
        yield stack


def _prompt(group: int, suffix: str) -> str:
    words = " ".join(f"w{group}x{i}" for i in range(120))
    return f"document {group}: {words}. question: {suffix}"


async def _scores(grpc_port: int, prompt: str) -> dict[str, float]:
    """Route one request on the replica at ``grpc_port`` the way Envoy would; its
    per-endpoint totals (``--scores-header``)."""
    payload = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stream = Stream(channel)
        await stream.send(
            headers(
                {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
            ),
            body(payload),
        )
        answers: list[pb.ProcessingResponse] = await stream.recv(1)
        await stream.close()
    assert answers[0].HasField("request_headers"), answers[0]
    return json.loads(set_headers(answers[0])["x-infergate-epp-scores"])


def test_a_replica_that_never_saw_a_request_scores_its_prefix_as_cached(
    stack: LocalStack,
) -> None:
    ports = [p[0] for p in stack.spec.resolved_epp_ports()]
    served: dict[int, str] = {}
    with httpx.Client(timeout=60) as client:
        for group in range(PROMPTS):
            response = client.post(
                f"{stack.base_url}/v1/completions",
                json={"model": "tiny", "prompt": _prompt(group, "first"), "max_tokens": 2},
            )
            assert response.status_code == 200, response.text
            served[group] = response.headers[UPSTREAM_HOST_HEADER]
    assert len(set(served.values())) == 2, served  # both engines hold some prefixes

    async def check() -> list[str]:
        wrong = []
        for group, engine in served.items():
            for port in ports:  # one of the two replicas never saw this prompt
                totals = await _scores(port, _prompt(group, f"again {port}"))
                other = max(v for k, v in totals.items() if k != engine)
                if not totals[engine] > other:
                    wrong.append(f"group {group} replica :{port}: {totals} (served by {engine})")
        return wrong

    deadline = time.monotonic() + 20
    wrong = asyncio.run(check())
    while wrong and time.monotonic() < deadline:  # records travel asynchronously
        time.sleep(0.5)
        wrong = asyncio.run(check())
    assert not wrong, wrong


def test_envoy_sends_to_a_live_replica_after_one_is_killed(stack: LocalStack) -> None:
    victim = stack.epps[1]
    assert victim is not None
    os.kill(victim.pid, signal.SIGKILL)
    if victim.popen is not None:
        victim.popen.wait(10)
    statuses = []
    with httpx.Client(timeout=60) as client:
        for i in range(20):
            response = client.post(
                f"{stack.base_url}/v1/completions",
                json={"model": "tiny", "prompt": f"after the kill {i}", "max_tokens": 2},
            )
            statuses.append(response.status_code)
    assert statuses == [200] * 20
    # `infergate up` restarts the dead replica while the other routes; it routes again.
    said: list[str] = []
    EppSupervisor(stack, said.append).check()
    assert said and "EPP replica 1 exited" in said[0]
    restarted = stack.epps[1]
    assert restarted is not None and restarted.alive() and restarted is not victim
    totals = asyncio.run(_scores(stack.spec.resolved_epp_ports()[1][0], _prompt(0, "back")))
    assert len(totals) == 2  # it serves ext-proc and sees both engines
