"""Priority is the pool owner's (epp/requestcontrol/priority.py): the InferenceObjective's,
unless the EPP runs with ``--client-priority-max``, and then clamped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from infergate.epp.requestcontrol.priority import clamp_client_priority, settle_priority
from infergate.epp.requestcontrol.requests import BadRequest
from infergate.epp.types import Endpoint, InferenceRequest

from .conftest import Stream, body, headers, set_headers

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
A = Endpoint("127.0.0.1", 18001)
OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 10}
"""


@pytest.mark.parametrize(
    ("asked", "ceiling", "got"),
    [(100, 5, 5), (5, 5, 5), (3, 5, 3), (-100, 5, -100), (0, -2, -2), (-7, -2, -7)],
)
def test_clamp_lets_clients_lower_freely_and_raise_up_to_the_bound(
    asked: int, ceiling: int, got: int
) -> None:
    assert clamp_client_priority(asked, ceiling) == got


def _settle(
    body: dict[str, Any] | None, objective: int, ceiling: int | None, **hdrs: str
) -> tuple[int, bool]:
    request = InferenceRequest("r", dict(hdrs), body=body)
    changed = settle_priority(request, body, objective, ceiling)
    return request.priority, changed


def test_by_default_the_objective_decides_and_the_body_field_goes() -> None:
    sent = {"model": "m", "priority": -100}
    assert _settle(sent, 10, None) == (10, True)
    assert "priority" not in sent
    plain = {"model": "m"}
    assert _settle(plain, 10, None) == (10, False)  # nothing to remove: no rewrite
    assert _settle({"model": "m"}, 0, None, **{"x-infergate-priority": "-100"}) == (0, False)


def test_opted_in_pool_clamps_body_and_header() -> None:
    urgent = {"model": "m", "priority": -100}  # vLLM's convention: asks for 100
    assert _settle(urgent, 0, 5) == (5, True)
    assert urgent["priority"] == -5
    relaxed = {"model": "m", "priority": 50}  # lowering its urgency: kept as sent
    assert _settle(relaxed, 10, 5) == (-50, False)
    assert relaxed["priority"] == 50
    assert _settle({"model": "m"}, 10, 5) == (10, False)  # asks nothing: the objective's
    assert _settle({"model": "m"}, 0, 5, **{"x-infergate-priority": "-100"}) == (5, False)
    with pytest.raises(BadRequest, match="'priority' must be an integer"):
        _settle({"priority": "high"}, 0, 5)
    with pytest.raises(BadRequest, match="x-infergate-priority"):
        _settle({}, 0, 5, **{"x-infergate-priority": "soon"})


async def _route(epp: Any, channel_for: Any, payload: dict[str, Any]) -> tuple[dict, dict]:
    """One request through the EPP's ext-proc: the headers it sets and the body it sends."""
    stream = Stream(channel_for(epp))
    hdrs = {**POST, "x-gateway-inference-objective": "critical", "x-infergate-priority": "-99"}
    raw = json.dumps(payload).encode()
    await stream.send(headers(hdrs), body(raw))
    header_response, body_response = await stream.recv(2)
    sent = body_response.request_body.response.body_mutation.streamed_response.body
    return set_headers(header_response), json.loads(sent)


async def test_ext_proc_sends_the_pool_owners_priority(
    epp_factory: Any, channel_for: Any, tmp_path: Path
) -> None:
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(OBJECTIVES)
    epp = await epp_factory(static_endpoints=[A], objectives_file=objectives)
    sent_headers, sent = await _route(
        epp, channel_for, {"model": "m", "prompt": "x", "priority": -100}
    )
    assert "priority" not in sent
    assert sent_headers["x-infergate-priority"] == "-10"  # the objective's, negated
    assert sent_headers["content-length"] == str(len(json.dumps(sent, separators=(",", ":"))))

    opted = await epp_factory(
        static_endpoints=[A], objectives_file=objectives, client_priority_max=20
    )
    sent_headers, sent = await _route(
        opted, channel_for, {"model": "m", "prompt": "x", "priority": -100}
    )
    assert sent["priority"] == -20
    assert sent_headers["x-infergate-priority"] == "-20"
