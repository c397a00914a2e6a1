"""Slow-upload flood against one EPP process: its RSS must stay under the documented bound.

N ext-proc streams (as Envoy would open them, over real gRPC) each send request headers
and then a large body in chunks, never finishing it. Without a cap every byte stays
buffered; with ``--max-buffered-bytes`` the EPP answers 503 beyond the budget and 408
at the body deadline. Prints the EPP's RSS over time and how the streams were answered.

    .venv/bin/python benchmarks/epp_flood.py --streams 200 --body-mib 4

``--through-stack`` floods ``infergate up``'s Envoy instead (one simulated engine, mutual
TLS to the EPP, as the fault run did) and samples the EPP's and Envoy's RSS together::

    .venv/bin/python benchmarks/epp_flood.py --through-stack --streams 100 --body-mib 8 --after 30

``--full-speed`` sends the pieces without pausing (issue 45's flood: 100 bodies of 8 MiB
as fast as the connection takes them); ``--after S`` reports the RSS S seconds after the
last stream ended (memory given back after a burst).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from infergate.epp.options import EPP_PORTS, EppOptions
from infergate.epp.types import Endpoint

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
    stub: pb_grpc.ExternalProcessorStub,
    body_bytes: int,
    chunk: int,
    hold_s: float,
    out: dict,
    pause_s: float = 0.05,
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
            await asyncio.sleep(pause_s)
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


async def _rss_after(pid: int, seconds: float) -> float:
    """The RSS ``seconds`` after the flood, printed each 5 s meanwhile."""
    waited = 0.0
    while waited < seconds:
        await asyncio.sleep(min(5.0, seconds - waited))
        waited += min(5.0, seconds - waited)
        print(f"after +{waited:4.0f}s  EPP RSS {_rss_mib(pid):7.1f} MiB", flush=True)
    return _rss_mib(pid)


async def _stack_flood(streams: int, body_bytes: int, after_s: float, body_mode: str) -> None:
    """100 POSTs of ``body_bytes`` at once through ``infergate up``'s Envoy, full speed;
    ``body_mode`` is Envoy's ``--request-body-mode`` (streamed or buffered)."""
    import httpx

    from infergate.stack.local import LocalStack, StackSpec

    workdir = Path(tempfile.mkdtemp(prefix="epp-flood-"))  # kept: the EPP's and Envoy's logs
    spec = StackSpec.on_free_ports(
        engines=1,
        simulate=True,
        secure_serving=True,
        workdir=workdir,
        request_body_mode=body_mode,
    )
    print(f"logs in {workdir}")
    with LocalStack(spec) as stack:
        assert stack.epp is not None and stack.envoy is not None
        pids = {"EPP": stack.epp.pid, "Envoy": stack.envoy.pid}
        await asyncio.sleep(3.0)
        idle = {name: _rss_mib(pid) for name, pid in pids.items()}
        peak = dict(idle)
        payload = b'{"model":"m","max_tokens":1,"prompt":"' + b"x" * (body_bytes - 64) + b'"}'
        limits = httpx.Limits(max_connections=streams)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            url = f"{stack.base_url}/v1/completions"
            sends = [client.post(url, content=payload) for _ in range(streams)]
            flood = asyncio.gather(*sends, return_exceptions=True)
            while not flood.done():
                await asyncio.sleep(0.1)
                for name, pid in pids.items():
                    peak[name] = max(peak[name], _rss_mib(pid))
            results = await flood
        codes = collections.Counter(getattr(r, "status_code", type(r).__name__) for r in results)
        await asyncio.sleep(after_s)
        print(
            f"{streams} POSTs x {body_bytes / 2**20:.0f} MiB through Envoy; answers {dict(codes)}"
        )
        for name, pid in pids.items():
            print(
                f"{name}: idle {idle[name]:.0f} MiB, peak {peak[name]:.0f} MiB, "
                f"{after_s:.0f} s after {_rss_mib(pid):.0f} MiB"
            )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--body-mib", type=float, default=4.0)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds to keep streams open")
    parser.add_argument("--full-speed", action="store_true", help="no pause between pieces")
    parser.add_argument("--through-stack", action="store_true", help="flood `infergate up`")
    parser.add_argument("--after", type=float, default=0.0, help="seconds to watch RSS after")
    parser.add_argument("--epp-arg", action="append", default=[])
    parser.add_argument(
        "--body-mode",
        choices=["streamed", "buffered"],
        default="streamed",
        help="with --through-stack: how Envoy hands bodies to the EPP",
    )
    args = parser.parse_args()
    if args.through_stack:
        await _stack_flood(args.streams, int(args.body_mib * 2**20), args.after, args.body_mode)
        return
    port, health, metrics = free_port(), free_port(), free_port()
    infergate = str(Path(sys.executable).with_name("infergate"))
    options = EppOptions(
        static_endpoints=[Endpoint("127.0.0.1", 1)], host="127.0.0.1", grpc_port=port,
        grpc_health_port=health, metrics_port=metrics, log_level="warning",
    )  # fmt: skip
    argv = [infergate, *options.argv(always=EPP_PORTS), *args.epp_arg]
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
                        stub,
                        int(args.body_mib * 2**20),
                        args.chunk_kib * 1024,
                        args.hold,
                        answers,
                        0.0 if args.full_speed else 0.05,
                    )
                )
                for _ in range(args.streams)
            ]
            started = time.monotonic()
            while not all(t.done() for t in tasks):
                await asyncio.sleep(0.2)
                rss = _rss_mib(epp.pid)
                peak = max(peak, rss)
                print(f"t={time.monotonic() - started:5.1f}s  EPP RSS {rss:7.1f} MiB", flush=True)
            await asyncio.gather(*tasks, return_exceptions=True)
        after = await _rss_after(epp.pid, args.after)
        print(
            f"\n{args.streams} streams x {args.body_mib} MiB, EPP args {args.epp_arg or 'defaults'}"
        )
        print(f"idle RSS {idle:.0f} MiB, peak {peak:.0f} MiB; answers {dict(answers)}")
        if args.after:
            print(f"RSS {args.after:.0f} s after the last stream: {after:.0f} MiB")
    finally:
        epp.terminate()
        epp.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
