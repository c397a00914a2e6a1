"""Request lifecycle details: SSE usage, trailers, debug header, metrics, no leaks."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from infergate.epp.config import parse_config
from infergate.epp.server.usage import UsageReader
from infergate.epp.types import Endpoint
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Stream, body, headers, response_body, response_headers, set_headers

POST = {":method": "POST", ":path": "/v1/chat/completions"}
A = Endpoint("127.0.0.1", 18201)
B = Endpoint("127.0.0.1", 18202)
CHAT = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "hi " * 100}],
        "max_tokens": 20,
        "stream": True,
    }
).encode()
CONFIG = """
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
- type: token-load-scorer
- type: session-affinity-scorer
- type: max-score-picker
"""


def test_usage_reader_json_and_sse() -> None:
    reader = UsageReader()
    doc = json.dumps({"id": "x", "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode()
    reader.feed(doc[:7])
    reader.feed(doc[7:])
    reader.finish()
    assert reader.usage == {"prompt_tokens": 5, "completion_tokens": 2}

    sse = UsageReader()
    sse.sse = True
    events = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n'
        b"data: [DONE]\n\n"
    )
    for i in range(0, len(events), 11):  # chunk boundaries split lines
        sse.feed(events[i : i + 11])
    sse.finish()
    assert sse.usage == {"prompt_tokens": 9, "completion_tokens": 4}


async def test_many_streams_leave_no_state(epp_factory, channel_for) -> None:
    epp = await epp_factory(
        static_endpoints=[A, B], config=parse_config(CONFIG), scores_header=True
    )
    channel = channel_for(epp)
    for i in range(60):
        stream = Stream(channel)
        await stream.send(headers(POST), body(CHAT[:40], end_of_stream=False))
        if i % 3 == 0:  # cancelled mid-body
            stream.call.cancel()
            continue
        await stream.send(body(CHAT[40:], end_of_stream=False))
        await stream.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        header_response, *bodies, trailers_response = await stream.recv(4)  # body as sent
        assert "x-infergate-epp-scores" in set_headers(header_response)
        streamed = [r.request_body.response.body_mutation.streamed_response for r in bodies]
        assert b"".join(c.body for c in streamed) == CHAT
        assert not any(c.end_of_stream for c in streamed)
        assert trailers_response.HasField("request_trailers")
        if i % 3 == 1:  # cancelled mid-response
            await stream.send(
                response_headers({":status": "200", "content-type": "text/event-stream"})
            )
            await stream.recv(1)
            stream.call.cancel()
            continue
        await stream.send(response_headers({":status": "200", "content-type": "text/event-stream"}))
        (rh,) = await stream.recv(1)
        assert "x-session-token" in set_headers(rh, "response_headers")
        await stream.send(
            response_body(
                b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n', False
            ),
            response_body(b"data: [DONE]\n\n", True),
        )
        await stream.recv(2)
        await stream.close()
    for _ in range(200):
        if epp.ext_proc.active_streams == 0:
            break
        await asyncio.sleep(0.02)
    assert epp.ext_proc.active_streams == 0
    for state in epp.datastore.all():
        assert state.in_flight_requests == 0
        assert state.in_flight_tokens == 0
    assert epp.metrics.tokens.labels("completion")._value.get() == 2 * 20  # 20 completed streams


async def test_metrics_endpoint_exposes_decisions(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A])
    channel = channel_for(epp)
    for _ in range(3):
        stream = Stream(channel)
        await stream.send(headers(POST), body(CHAT))
        await stream.recv(2)
        await stream.close()
    stream = Stream(channel)
    await stream.send(headers(POST), body(b"nope"))
    await stream.recv(1)

    def scrape() -> dict[str, list]:
        url = f"http://127.0.0.1:{epp.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    families = await asyncio.to_thread(scrape)
    outcomes = {
        s.labels["outcome"]: s.value
        for s in families["infergate_epp_requests"]
        if s.name.endswith("_total")
    }
    assert outcomes == {"routed": 3.0, "bad_request_400": 1.0}
    count = [
        s.value
        for s in families["infergate_epp_scheduling_duration_seconds"]
        if s.name.endswith("_count")
    ]
    assert count == [3.0]
    plugins = {s.labels["plugin_type"] for s in families["infergate_epp_plugin_duration_seconds"]}
    assert {"predicted-latency-scorer", "prefix-cache-scorer", "max-score-picker"} <= plugins
    assert [s.labels["endpoint"] for s in families["infergate_epp_endpoint_queue_size"]] == [A.key]
    assert any(
        s.name.endswith("_count") and s.value == 3
        for s in families["infergate_epp_prefix_indexer_hit_ratio"]
    )
    # GIE's names next to ours, so GIE's dashboards work.
    assert any(
        s.name.endswith("_count") and s.value == 3
        for s in families["inference_extension_prefix_indexer_hit_ratio"]
    )
    assert [s.value for s in families["inference_pool_ready_pods"]] == [1.0]
    assert sum(
        s.value for s in families["inference_objective_request"] if s.name.endswith("_total")
    ) == 3.0


async def test_debug_log_line_has_per_scorer_scores(epp_factory, channel_for, caplog) -> None:
    import logging

    epp = await epp_factory(static_endpoints=[A, B])
    caplog.set_level(logging.DEBUG, logger="infergate.epp.requestcontrol.director")
    stream = Stream(channel_for(epp))
    await stream.send(headers({**POST, "x-request-id": "req-42"}), body(CHAT))
    await stream.recv(2)
    (line,) = [r.getMessage() for r in caplog.records if "req-42" in r.getMessage()]
    for scorer in ("predicted-latency-scorer",):
        assert scorer in line
    assert A.key in line and B.key in line
