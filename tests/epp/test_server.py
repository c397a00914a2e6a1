"""The ext-proc server driven by a real grpc.aio client, message by message as Envoy does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
from google.protobuf import json_format
from infergate.epp.datalayer.objectives import parse_object
from infergate.epp.types import Endpoint

from .conftest import (
    Stream,
    body,
    headers,
    response_body,
    response_headers,
    set_headers,
)

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
A = Endpoint("127.0.0.1", 18001)
B = Endpoint("127.0.0.1", 18002)
C = Endpoint("127.0.0.2", 18003)


def _completion(prompt: str = "hello", model: str = "m", **extra: object) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, **extra}).encode()


async def test_routes_at_end_of_body_and_streams_body_back(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A, B])
    stream = Stream(channel_for(epp))
    payload = _completion("x" * 200)
    await stream.send(headers(POST), body(payload[:50], end_of_stream=False))
    await stream.send(body(payload[50:], end_of_stream=True))
    header_response, first, second = await stream.recv(3)
    destination = set_headers(header_response)["x-gateway-destination-endpoint"]
    assert header_response.request_headers.response.clear_route_cache
    # The default picker names the primary first and the other endpoint as its fallback:
    # the ordered list in the envoy.lb metadata, the primary alone in the header (what
    # an ORIGINAL_DST cluster keyed on it can dial).
    dynamic = json_format.MessageToDict(header_response.dynamic_metadata)
    listed = dynamic["envoy.lb"]["x-gateway-destination-endpoint"].split(",")
    assert dynamic == {"envoy.lb": {"x-gateway-destination-endpoint": ",".join(listed)}}
    assert sorted(listed) == sorted([A.key, B.key])
    assert destination == listed[0]
    # The unchanged body goes back as Envoy sent it: the same two chunks, end on the last.
    streamed = [r.request_body.response.body_mutation.streamed_response for r in (first, second)]
    assert [c.body for c in streamed] == [payload[:50], payload[50:]]
    assert [c.end_of_stream for c in streamed] == [False, True]

    # Response side: headers and body pass through; the served endpoint is reported.
    await stream.send(
        response_headers(
            {":status": "200", "content-type": "application/json"},
            metadata={"envoy.lb": {"x-gateway-destination-endpoint-served": destination}},
        )
    )
    (resp_headers,) = await stream.recv(1)
    assert (
        set_headers(resp_headers, "response_headers")["x-gateway-destination-endpoint-served"]
        == destination
    )
    usage = json.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 3}}).encode()
    await stream.send(response_body(usage[:10], False), response_body(usage[10:], True))
    chunks = await stream.recv(2)
    assert (
        b"".join(c.response_body.response.body_mutation.streamed_response.body for c in chunks)
        == usage
    )
    await stream.close()
    await asyncio.sleep(0.05)
    assert epp.ext_proc.active_streams == 0
    assert sum(s.in_flight_requests for s in epp.datastore.all()) == 0
    assert epp.metrics.tokens.labels("completion")._value.get() == 3


async def test_get_without_body_is_routed_at_headers(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A])
    stream = Stream(channel_for(epp))
    await stream.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
    (response,) = await stream.recv(1)
    assert set_headers(response)["x-gateway-destination-endpoint"] == A.key
    await stream.close()


async def test_subset_hint_restricts_candidates(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A, B, C])
    for _ in range(10):
        stream = Stream(channel_for(epp))
        hint = {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": [C.key]}}
        await stream.send(headers(POST, metadata=hint), body(_completion()))
        header_response, _ = await stream.recv(2)
        assert set_headers(header_response)["x-gateway-destination-endpoint"] == C.key
        await stream.close()
    # A subset naming nothing we know is a 503.
    stream = Stream(channel_for(epp))
    hint = {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["10.9.9.9:1"]}}
    await stream.send(headers(POST, metadata=hint), body(_completion()))
    (response,) = await stream.recv(1)
    assert response.immediate_response.status.code == 503


async def test_fallbacks_come_comma_separated(epp_factory, channel_for) -> None:
    config = """
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- {type: max-score-picker, parameters: {maxNumOfEndpoints: 3}}
"""
    from infergate.epp.config import parse_config

    epp = await epp_factory(static_endpoints=[A, B, C], config=parse_config(config))
    stream = Stream(channel_for(epp))
    await stream.send(headers(POST), body(_completion()))
    header_response, _ = await stream.recv(2)
    value = set_headers(header_response)["x-gateway-destination-endpoint"]
    dynamic = json_format.MessageToDict(header_response.dynamic_metadata)
    listed = dynamic["envoy.lb"]["x-gateway-destination-endpoint"].split(",")
    assert sorted(listed) == sorted([A.key, B.key, C.key])
    assert value == listed[0]  # the header: the primary alone


async def test_model_rewrite_changes_body_and_content_length(
    epp_factory, channel_for, tmp_path: Path
) -> None:
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(
        """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: food}
spec:
  rules:
  - matches: [{model: {value: food-review}}]
    targets: [{modelRewrite: food-review-v2, weight: 1}]
"""
    )
    epp = await epp_factory(static_endpoints=[A], objectives_file=objectives)
    stream = Stream(channel_for(epp))
    await stream.send(headers(POST), body(_completion(model="food-review")))
    header_response, body_response = await stream.recv(2)
    sent = body_response.request_body.response.body_mutation.streamed_response.body
    assert json.loads(sent)["model"] == "food-review-v2"
    assert set_headers(header_response)["content-length"] == str(len(sent))

    # GIE's x-gateway-model-name-rewrite header forces the target model.
    stream = Stream(channel_for(epp))
    await stream.send(
        headers({**POST, "x-gateway-model-name-rewrite": "forced"}),
        body(_completion(model="food-review")),
    )
    _, body_response = await stream.recv(2)
    sent = body_response.request_body.response.body_mutation.streamed_response.body
    assert json.loads(sent)["model"] == "forced"


async def test_rejections(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], max_request_body_bytes=1000)
    channel = channel_for(epp)

    stream = Stream(channel)
    await stream.send(headers(POST), body(b"{not json"))
    (bad,) = await stream.recv(1)
    assert bad.immediate_response.status.code == 400
    assert "not valid JSON" in json.loads(bad.immediate_response.body)["error"]["message"]

    stream = Stream(channel)
    await stream.send(
        headers(POST), body(b"x" * 600, end_of_stream=False), body(b"x" * 600, end_of_stream=False)
    )
    (big,) = await stream.recv(1)
    assert big.immediate_response.status.code == 413

    stream = Stream(channel)
    await stream.send(headers(POST), body(json.dumps({"model": 5}).encode()))
    (typed,) = await stream.recv(1)
    assert typed.immediate_response.status.code == 400

    # Sheddable (priority < 0) traffic is shed while every endpoint is saturated (here: no
    # metrics yet, hence stale); critical traffic is still routed.
    epp.objectives.replace(
        [
            parse_object(
                {
                    "kind": "InferenceObjective",
                    "metadata": {"name": "batch"},
                    "spec": {"priority": -1},
                }
            )
        ],
        [],
    )
    stream = Stream(channel)
    await stream.send(
        headers({**POST, "x-gateway-inference-objective": "batch"}), body(_completion())
    )
    (shed,) = await stream.recv(1)
    assert shed.immediate_response.status.code == 429
    stream = Stream(channel)
    await stream.send(headers(POST), body(_completion()))
    header_response, _ = await stream.recv(2)
    assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key


async def test_objective_priority_goes_to_the_engine_negated(epp_factory, channel_for) -> None:
    """GIE's objective priority (higher: more important) reaches the engine in vLLM's
    convention (lower runs first); a client's own header is overwritten."""
    epp = await epp_factory(static_endpoints=[A])
    epp.objectives.replace(
        [
            parse_object({"kind": "InferenceObjective", "metadata": {"name": name}, "spec": spec})
            for name, spec in (
                ("chat", {"priority": 10}),
                ("bulk", {"priority": 1}),
                ("plain", {}),
            )
        ],
        [],
    )
    channel = channel_for(epp)
    seen = {}
    # (A negative objective would be shed here: this pool has no metrics, so it counts
    # as saturated; the mapping is the same negation.)
    for objective in ("chat", "bulk", "plain", "unknown", None):
        sent = {**POST, "x-infergate-priority": "-1000"}
        if objective is not None:
            sent["x-gateway-inference-objective"] = objective
        stream = Stream(channel)
        await stream.send(headers(sent), body(_completion()))
        header_response, _ = await stream.recv(2)
        seen[objective] = set_headers(header_response)["x-infergate-priority"]
        await stream.close()
    assert seen == {"chat": "-10", "bulk": "-1", "plain": "0", "unknown": "0", None: "0"}


async def test_no_endpoint_is_503(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[])
    stream = Stream(channel_for(epp))
    await stream.send(headers(POST), body(_completion()))
    (response,) = await stream.recv(1)
    assert response.immediate_response.status.code == 503
    assert json.loads(response.immediate_response.body)["error"]["code"] == 503


async def test_cancelled_streams_release_state(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A, B])
    channel = channel_for(epp)
    for i in range(50):
        stream = Stream(channel)
        await stream.send(headers(POST), body(_completion("p" * (100 + i))))
        await stream.recv(2)
        if i % 2:
            await stream.send(response_headers({":status": "200"}))
            await stream.recv(1)
        stream.call.cancel()  # Envoy gave up (client went away)
    for _ in range(100):
        if epp.ext_proc.active_streams == 0:
            break
        await asyncio.sleep(0.02)
    assert epp.ext_proc.active_streams == 0
    assert all(s.in_flight_requests == 0 for s in epp.datastore.all())


async def test_garbage_never_crashes_the_server(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A])
    channel = channel_for(epp)
    # Body before headers, response before request, empty messages, odd bodies.
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    stream = Stream(channel)
    await stream.send(body(b"{}"), response_body(b"zz", True), pb.ProcessingRequest())
    (stray,) = await stream.recv(1)
    assert stray.response_body.response.body_mutation.streamed_response.body == b"zz"
    await stream.send(headers(POST), body(b"\xff\xfe", True))
    (response,) = await stream.recv(1)
    assert response.immediate_response.status.code == 400
    await stream.close()
    for payload in (
        b"[]",
        b"null",
        b'{"prompt": {"a": 1}}',
        b'{"messages": "hi"}',
        b'{"max_tokens": -1}',
    ):
        stream = Stream(channel)
        await stream.send(headers(POST), body(payload))
        (response,) = await stream.recv(1)
        assert response.immediate_response.status.code == 400, payload
    # Still serving.
    stream = Stream(channel)
    await stream.send(headers(POST), body(_completion()))
    header_response, _ = await stream.recv(2)
    assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key
    assert isinstance(channel, grpc.aio.Channel)


async def test_secure_serving_with_a_self_signed_certificate(epp_factory) -> None:
    epp = await epp_factory(static_endpoints=[A], secure_serving=True)
    assert epp.certificate is not None and b"BEGIN CERTIFICATE" in epp.certificate
    credentials = grpc.ssl_channel_credentials(root_certificates=epp.certificate)
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{epp.grpc_port}",
        credentials,
        options=[("grpc.ssl_target_name_override", "localhost")],
    ) as channel:
        stream = Stream(channel)
        await stream.send(headers(POST), body(_completion()))
        header_response, _ = await stream.recv(2)
        assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as plain:
        stream = Stream(plain)
        try:
            await stream.send(headers(POST), body(_completion()))
            await stream.recv(1, timeout=5)
        except (grpc.aio.AioRpcError, AssertionError, TimeoutError):
            pass  # a plaintext client cannot talk to the TLS port
        else:
            raise AssertionError("plaintext client was served on the TLS port")
