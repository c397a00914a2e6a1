"""EPP CPU per request on its request path, in process: A/B of two ext-proc server versions.

What the EPP does per routed request apart from gRPC transport: read the headers, buffer
the body chunks, parse, schedule (the default profile over 4 endpoints), build the
headers response and the body going back, then the response headers and the end of
the request. Real protobuf messages as Envoy sends them (the body in 16 KiB chunks, as
Envoy's HTTP/1 codec hands them over), driven through ``StreamState.handle``. The
versions run interleaved, ``--rounds`` times each, in one process, so the machine's
load (shared here) hits both alike; the figure is the median of rounds of process CPU
time per request.

    git archive REV epp/server | tar -x -C /tmp/before
    .venv/bin/python benchmarks/epp_request_path.py --baseline /tmp/before/epp/server

The baseline is a copy of another version's ``epp/server/`` package, or of its single
``epp/server.py`` (the trees before the package).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gateway_rig import body_of_size
from infergate.epp.app import Epp, EppOptions
from infergate.epp.server import extproc, stream
from infergate.epp.types import Endpoint

ENVOY_CHUNK = 16 << 10


def _load(path: Path) -> SimpleNamespace:
    """The baseline's ``ExtProcServer`` and ``StreamState``, from a ``server.py`` file or an
    ``epp/server`` package directory (its modules import each other relatively, so the
    copy's own modules are the ones loaded)."""
    name = "epp_server_baseline"
    package = path.is_dir()
    location = path / "__init__.py" if package else path
    search = [str(path)] if package else None
    spec = importlib.util.spec_from_file_location(name, location, submodule_search_locations=search)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a server.py or an epp/server directory")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not package:
        return SimpleNamespace(ExtProcServer=module.ExtProcServer, StreamState=module.StreamState)
    return SimpleNamespace(
        ExtProcServer=importlib.import_module(f"{name}.extproc").ExtProcServer,
        StreamState=importlib.import_module(f"{name}.stream").StreamState,
    )


def _messages(body: bytes) -> tuple[list[pb.ProcessingRequest], pb.ProcessingRequest]:
    items = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
    request = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv)))
    ]
    for start in range(0, len(body), ENVOY_CHUNK):
        piece = body[start : start + ENVOY_CHUNK]
        request.append(
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=piece, end_of_stream=start + ENVOY_CHUNK >= len(body))
            )
        )
    status = [base_pb2.HeaderValue(key=":status", raw_value=b"200")]
    response = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=status), end_of_stream=True
        )
    )
    return request, response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline", type=Path, required=True, help="the other epp/server dir or server.py"
    )
    parser.add_argument("--sizes", default="2048,225280")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    current = SimpleNamespace(ExtProcServer=extproc.ExtProcServer, StreamState=stream.StreamState)
    versions = {"baseline": _load(args.baseline), "current": current}
    endpoints = [Endpoint(f"10.0.0.{i}", 8000) for i in range(1, 5)]
    results: dict[tuple[str, int], list[float]] = {}

    async def run(module: SimpleNamespace, epp: Epp, body: bytes) -> float:
        server = module.ExtProcServer(epp.director)
        request, response = _messages(body)
        for i in range(args.requests + 20):
            if i == 20:
                started = time.process_time()
            state = module.StreamState(server)
            for message in request:
                await state.handle(message)
            await state.handle(response)
            state.close()
        return (time.process_time() - started) * 1000 / args.requests

    for size in (int(s) for s in args.sizes.split(",")):
        import json

        body = json.dumps(body_of_size(size)).encode()
        for _ in range(args.rounds):
            for name, module in versions.items():
                epp = Epp(EppOptions(static_endpoints=endpoints))
                ms = asyncio.run(run(module, epp, body))
                results.setdefault((name, size), []).append(ms)
    print(
        f"EPP request-path CPU ms per request (median of {args.rounds} rounds, {args.requests} each)"
    )
    for size in (int(s) for s in args.sizes.split(",")):
        base = statistics.median(results[("baseline", size)])
        now = statistics.median(results[("current", size)])
        spread = max(results[("current", size)]) / min(results[("current", size)]) - 1
        print(
            f"{size:>7} B  baseline {base:.3f}  current {now:.3f}  ({now / base - 1:+.0%}; "
            f"current's rounds spread {spread:.0%})"
        )


if __name__ == "__main__":
    main()
