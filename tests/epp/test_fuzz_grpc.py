"""10,000 malformed ext-proc streams over real gRPC against a real ``infergate epp`` process,
and its RSS under a slow-upload flood.

The in-process fuzz (``test_fuzz.py``) drives ``StreamState`` directly; this one goes
through what Envoy talks to — the grpc.aio server, the stream lifecycle, the limits — in
a separate process whose log is read afterwards: no stream is answered 500, the log holds
no traceback and no ERROR line, and the process keeps serving. Streams come in kinds:
malformed bodies (bad JSON, nesting depth, huge integers, lone surrogates, non-string
content, random bytes; seeded, see ``test_fuzz._malformed``), wrong headers (no method
or path, odd content types, bytes that are not UTF-8, headers only), messages out of
order (response messages first, bodies after the end of stream, empty messages), and
truncated streams (the client goes away mid-body).

The flood: 100 streams each trickling a 2 MiB body that never ends, against
``--max-buffered-bytes 16 MiB``; the peak RSS must stay under the bound the server's
docstring states (idle + 3 x the byte budget + ~20 KiB per stream), plus what gRPC
itself holds for unread messages (its flow-control windows; 64 MiB allowed here).
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from infergate.procs import free_port, tcp_ready

from .test_fuzz import _malformed, _stream

STREAMS = 10_000
CONCURRENCY = 64


@dataclass
class EppProcess:
    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_url: str
    log: Path

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def _start_epp(tmp_path: Path, *args: str) -> Iterator[EppProcess]:
    port, health, metrics = free_port(), free_port(), free_port()
    log = tmp_path / "epp.log"
    argv = [str(Path(sys.executable).with_name("infergate")), "epp", "--endpoint", "127.0.0.1:1"]
    argv += ["--host", "127.0.0.1", "--grpc-port", str(port), "--grpc-health-port", str(health)]
    argv += ["--metrics-port", str(metrics), "--log-level", "info", *args]
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    epp = EppProcess(process, port, f"http://127.0.0.1:{metrics}/metrics", log)
    try:
        deadline = time.monotonic() + 60
        ready = tcp_ready("127.0.0.1", port)
        while not ready():
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the EPP did not start"
            time.sleep(0.2)
        yield epp
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def fuzz_epp(tmp_path: Path) -> Iterator[EppProcess]:
    yield from _start_epp(tmp_path, "--max-request-body-bytes", "65536")


def _raw_headers(items: list[tuple[str, bytes]], eos: bool = False) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in items]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=eos)
    )


_BODY = pb.ProcessingRequest(
    request_body=pb.HttpBody(body=b'{"model":"m","prompt":"hi"}', end_of_stream=True)
)
_WRONG_HEADERS: list[list[tuple[str, bytes]]] = [
    [],
    [(":method", b"POST")],
    [(":path", b"/v1/completions")],
    [(":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"text/plain")],
    [(":method", b"\xff\xfe"), (":path", b"/\xc3\x28"), ("x-request-id", b"\xed\xa0\x80")],
    [(":method", b"POST"), (":path", b"/v1/completions"), ("x-gateway-inference-objective", b"\x00" * 300)],
    [(":method", b"POST"), (":path", b"/x"), ("x-gateway-model-name-rewrite", b"\xff")],
    [(":method", b"POST"), (":path", b"/v1/completions"), ("content-length", b"-1")],
    [(":method", b"GET"), (":path", b"/v1/models"), ("x" * 200, b"y" * 8000)],
]  # fmt: skip


def _wrong_headers(rng: random.Random) -> list[pb.ProcessingRequest]:
    items = rng.choice(_WRONG_HEADERS)
    if rng.random() < 0.3:
        return [_raw_headers(items, eos=True)]
    return [_raw_headers(items), _BODY]


def _out_of_order(rng: random.Random) -> list[pb.ProcessingRequest]:
    post = [(":method", b"POST"), (":path", b"/v1/completions")]
    choices = [
        pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n", end_of_stream=True)),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
        pb.ProcessingRequest(),
        _BODY,
        _raw_headers(post),
    ]
    return [rng.choice(choices) for _ in range(rng.randint(1, 5))]


def _one_stream(rng: random.Random) -> tuple[str, list[pb.ProcessingRequest], bool]:
    """(kind, messages, truncated: the client cancels after sending them)."""
    kind = rng.choices(["body", "headers", "order", "truncated"], [70, 12, 10, 8])[0]
    if kind == "body":
        return kind, _stream(rng, _malformed(rng)), False
    if kind == "headers":
        return kind, _wrong_headers(rng), False
    if kind == "order":
        return kind, _out_of_order(rng), False
    messages = _stream(rng, _malformed(rng))
    return kind, messages[: rng.randint(1, max(1, len(messages) - 1))], True


async def _drive(
    stub: pb_grpc.ExternalProcessorStub,
    messages: list[pb.ProcessingRequest],
    truncated: bool,
    statuses: collections.Counter[str],
) -> None:
    call = stub.Process()
    try:
        for message in messages:
            await call.write(message)
        if truncated:
            await asyncio.sleep(0)
            call.cancel()
            statuses["cancelled by the client"] += 1
            return
        await call.done_writing()
        answered = False
        while (reply := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
            if reply.HasField("immediate_response"):
                statuses[str(reply.immediate_response.status.code)] += 1
                answered = True
            elif reply.HasField("request_headers") and not answered:
                statuses["routed"] += 1
                answered = True
        if not answered:
            statuses["no answer"] += 1
    except grpc.aio.AioRpcError as error:  # the server closed the stream on its side
        statuses[f"grpc {error.code().name}"] += 1
    except grpc.aio.UsageError:  # written after the server answered and closed
        statuses["closed by the server"] += 1


def _one_good_request(grpc_port: int) -> collections.Counter[str]:
    """Send one well-formed completion request to the EPP; the outcomes it got."""
    ok: collections.Counter[str] = collections.Counter()
    post = [(":method", b"POST"), (":path", b"/v1/completions")]

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            await _drive(pb_grpc.ExternalProcessorStub(channel), [_raw_headers(post), _BODY],
                         False, ok)  # fmt: skip

    asyncio.run(run())
    return ok


def _metric(url: str, name: str, label: str) -> float:
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_ten_thousand_malformed_grpc_streams_give_no_500_and_no_traceback(
    fuzz_epp: EppProcess,
) -> None:
    rng = random.Random(2917)
    streams = [_one_stream(rng) for _ in range(STREAMS)]
    statuses: collections.Counter[str] = collections.Counter()
    kinds = collections.Counter(kind for kind, _, _ in streams)

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{fuzz_epp.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            queue = iter(streams)

            async def worker() -> None:
                for _, messages, truncated in queue:
                    await _drive(stub, messages, truncated, statuses)

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    asyncio.run(run())
    print(f"kinds {dict(kinds)}; answers {dict(statuses)}")
    assert sum(statuses.values()) == STREAMS, statuses
    assert "500" not in statuses, statuses
    assert not any(s.startswith("grpc") for s in statuses), statuses
    assert statuses["400"] > 5_000, statuses  # most are malformed bodies
    assert kinds["truncated"] > 500 and kinds["headers"] > 1000, kinds
    # Still serving: a well-formed request is routed.
    assert _one_good_request(fuzz_epp.grpc_port) == {"routed": 1}
    assert _metric(fuzz_epp.metrics_url, "infergate_epp_requests_total", 'outcome="error"') == 0
    log = fuzz_epp.log.read_text(errors="replace")
    assert "Traceback" not in log
    assert not re.search(r"\b(ERROR|CRITICAL)\b", log), log[-3000:]


# --- RSS under a slow-upload flood ----------------------------------------------------

FLOOD_STREAMS = 100
FLOOD_BODY = 2 << 20
BUDGET = 16 << 20
GRPC_SLACK_MIB = 64


@pytest.fixture
def flood_epp(tmp_path: Path) -> Iterator[EppProcess]:
    yield from _start_epp(
        tmp_path, "--max-buffered-bytes", str(BUDGET), "--body-timeout", "4s",
        "--log-level", "warning",
    )  # fmt: skip


async def _slow_upload(stub: pb_grpc.ExternalProcessorStub, answers: collections.Counter[str]) -> None:
    call = stub.Process()
    answer = "held"
    try:
        await call.write(_raw_headers([(":method", b"POST"), (":path", b"/v1/completions")]))
        piece = b'{"model":"m","prompt":"' + b"x" * (128 << 10)
        sent = 0
        while sent < FLOOD_BODY:
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece)))
            sent += len(piece)
            await asyncio.sleep(0.05)
        reply = await asyncio.wait_for(call.read(), 10)
        if reply is not grpc.aio.EOF and reply.HasField("immediate_response"):
            answer = str(reply.immediate_response.status.code)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError):
        try:  # answered (503/408) and closed while we were still writing
            reply = await asyncio.wait_for(call.read(), 1)
            if reply is not grpc.aio.EOF and reply.HasField("immediate_response"):
                answer = str(reply.immediate_response.status.code)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError):
            pass
    finally:
        answers[answer] += 1
        call.cancel()


def test_rss_under_a_slow_upload_flood_stays_under_the_documented_bound(
    flood_epp: EppProcess,
) -> None:
    idle = flood_epp.rss_mib()
    answers: collections.Counter[str] = collections.Counter()
    peak = idle

    async def run() -> None:
        nonlocal peak
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{flood_epp.grpc_port}",
            options=[("grpc.max_send_message_length", 16 << 20)],
        ) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            tasks = [asyncio.create_task(_slow_upload(stub, answers)) for _ in range(FLOOD_STREAMS)]
            while not all(t.done() for t in tasks):
                await asyncio.sleep(0.25)
                peak = max(peak, flood_epp.rss_mib())
            await asyncio.gather(*tasks)

    asyncio.run(run())
    bound = idle + 3 * BUDGET / 2**20 + FLOOD_STREAMS * 20 / 1024 + GRPC_SLACK_MIB
    print(f"idle {idle:.0f} MiB, peak {peak:.0f} MiB, bound {bound:.0f} MiB; {dict(answers)}")
    assert peak <= bound, f"peak RSS {peak:.0f} MiB over {bound:.0f} (idle {idle:.0f})"
    # Nothing held: every stream was refused (503) or timed out (408), none kept.
    assert sum(answers.values()) == FLOOD_STREAMS
    assert set(answers) <= {"503", "408"}, answers
    assert answers["503"] > 0, answers
    assert flood_epp.process.poll() is None


# --- corrupt protobuf frames ----------------------------------------------------------

_CORRUPT = b"\xff\xff\xff\xff\x0f"  # a field tag with no valid wire type: not any message


async def _raw_call(channel: grpc.aio.Channel, method: str, frames: list[bytes]) -> str:
    """Send raw frames (serialized by hand) on ``method``; the stream's gRPC status."""
    call = channel.stream_stream(
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )()
    try:
        for frame in frames:
            await call.write(frame)
        await call.done_writing()
        while await asyncio.wait_for(call.read(), 30) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code().name
    except grpc.aio.UsageError:  # the server ended the stream while we still wrote
        pass
    return (await call.code()).name


def test_corrupt_frames_log_one_line_each_and_no_traceback(fuzz_epp: EppProcess) -> None:
    """A frame that is not a protobuf message ends its stream with INVALID_ARGUMENT and
    one warning; gRPC's own handler would log a traceback per stream. EDS too, and one
    mid-request (headers seen, part of a body buffered). Routing goes on."""
    process = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    eds = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
    post = [(":method", b"POST"), (":path", b"/v1/completions")]
    held = [
        _raw_headers(post).SerializeToString(),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model":')).SerializeToString(),
        _CORRUPT,
    ]

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{fuzz_epp.grpc_port}") as channel:
            codes = [await _raw_call(channel, process, [_CORRUPT]) for _ in range(3)]
            codes.append(await _raw_call(channel, process, held))
            codes.append(await _raw_call(channel, eds, [_CORRUPT]))
            return codes

    codes = asyncio.run(run())
    assert codes[:4] == ["INVALID_ARGUMENT"] * 4, codes
    assert _one_good_request(fuzz_epp.grpc_port) == {"routed": 1}
    time.sleep(0.5)  # let the EDS reader's line reach the log
    log = fuzz_epp.log.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "corrupt frame" in line]
    assert len(lines) == 5, lines
    assert sum("ext-proc stream" in line for line in lines) == 4
    assert all("WARNING" in line for line in lines)
