"""infergate's default profile (predicted latency over the calibrated prefix index), end to
end: real Envoy, real EPP, real simulated engines.

A prefix group sticks to the engine that holds it while that engine keeps up, and spreads
to a second engine once the holder's queued prefill makes recomputing the prefix
elsewhere the faster choice.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.envoy.bootstrap import UPSTREAM_HOST_HEADER
from infergate.stack.local import LocalStack, StackSpec


@pytest.fixture(scope="module")
def default_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        access_log=False,
        workdir=tmp_path_factory.mktemp("default-profile"),
        start_timeout=180.0,
    )  # no epp_config_file: the EPP runs its built-in default profile
    with LocalStack(spec) as running:
        yield running


async def _complete(client: httpx.AsyncClient, stack: LocalStack, prompt: str) -> str:
    response = await client.post(
        f"{stack.base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 0
    return response.headers[UPSTREAM_HOST_HEADER]


def _words(n: int) -> str:
    return " ".join(uuid.uuid4().hex[:6] for _ in range(n))


async def test_a_group_sticks_while_its_engine_keeps_up_and_spreads_when_overloaded(
    default_stack: LocalStack,
) -> None:
    group = f"Group {uuid.uuid4()}: " + _words(100)
    async with httpx.AsyncClient(timeout=60.0) as client:
        # Warm-up: responses teach the EPP characters per token; one at a time, the holder
        # is always the faster choice, so the group sticks.
        sticky = [await _complete(client, default_stack, f"{group}\nQ{i}?") for i in range(6)]
        assert len(set(sticky)) == 1, f"one prefix group went to {Counter(sticky)}"
        holder = sticky[0]
        # A burst of the same group, each with a long question of its own: every request
        # queues a lot of uncached prefill on the holder, so after a few, recomputing the
        # prefix on the other engine is predicted faster and the group spreads.
        burst = await asyncio.gather(
            *[_complete(client, default_stack, f"{group}\nQ{i}: {_words(120)}") for i in range(16)]
        )
    served = Counter(burst)
    assert len(served) == 2, f"the overloaded group never left its holder: {served}"
    assert served[holder] >= 1
