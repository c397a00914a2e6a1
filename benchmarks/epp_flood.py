"""Slow-upload flood against one EPP process: its RSS must stay under the documented bound.

N ext-proc streams (as Envoy would open them, over real gRPC) each send request headers
and then a large body in chunks, never finishing it. Without a cap every byte stays
buffered; with ``--max-buffered-bytes`` the EPP answers 503 beyond the budget and 408
at the body deadline. Prints the EPP's RSS over time and how the streams were answered.

    .venv/bin/python benchmarks/epp_flood.py --streams 200 --body-mib 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import time
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from infergate.procs import free_port


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _headers() -> pb.ProcessingRequest:
    items = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv))
    )


async def _slow_upload(
    stub: pb_grpc.ExternalProcessorStub, body_bytes: int, chunk: int, hold_s: float, out: dict
) -> None:
    call = stub.Process()
    answer = "held (no answer)"
    try:
        await call.write(_headers())
        sent = 0
        piece = b'{"model":"m","prompt":"' + b"x" * chunk
        while sent < body_bytes:
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece)))
            sent += len(piece)
            await asyncio.sleep(0.05)
        reply = await asyncio.wait_for(call.read(), hold_s)
        if reply is not grpc.aio.EOF and reply.HasField("immediate_response"):
            answer = str(reply.immediate_response.status.code)
    except (TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.UsageError):
        pass
    except Exception as error:  # the stream was answered and closed mid-write
        answer = type(error).__name__
    finally:
        if answer == "held (no answer)":
            try:
                reply = await asyncio.wait_for(call.read(), 0.01)
                if reply is not grpc.aio.EOF and reply.HasField("immediate_response"):
                    answer = str(reply.immediate_response.status.code)
            except (Exception, asyncio.CancelledError):
                pass
        out[answer] = out.get(answer, 0) + 1
        call.cancel()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--body-mib", type=float, default=4.0)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds to keep streams open")
    parser.add_argument("--epp-arg", action="append", default=[])
    args = parser.parse_args()
    port, health, metrics = free_port(), free_port(), free_port()
    infergate = str(Path(sys.executable).with_name("infergate"))
    argv = [infergate, "epp", "--endpoint", "127.0.0.1:1"]
    argv += ["--host", "127.0.0.1", "--grpc-port", str(port), "--grpc-health-port", str(health)]
    argv += ["--metrics-port", str(metrics), "--log-level", "warning", *args.epp_arg]
    epp = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.sleep(4.0)
        idle = _rss_mib(epp.pid)
        answers: dict[str, int] = collections.Counter()
        peak = idle
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 16 << 20)]
        ) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            tasks = [
                asyncio.create_task(
                    _slow_upload(
                        stub, int(args.body_mib * 2**20), args.chunk_kib * 1024, args.hold, answers
                    )
                )
                for _ in range(args.streams)
            ]
            started = time.monotonic()
            while not all(t.done() for t in tasks):
                await asyncio.sleep(1.0)
                rss = _rss_mib(epp.pid)
                peak = max(peak, rss)
                print(f"t={time.monotonic() - started:5.1f}s  EPP RSS {rss:7.1f} MiB", flush=True)
            await asyncio.gather(*tasks, return_exceptions=True)
        print(
            f"\n{args.streams} streams x {args.body_mib} MiB, EPP args {args.epp_arg or 'defaults'}"
        )
        print(f"idle RSS {idle:.0f} MiB, peak {peak:.0f} MiB; answers {dict(answers)}")
    finally:
        epp.terminate()
        epp.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
