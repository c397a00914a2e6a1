"""EPP overhead, side by side: Envoy + EPP minus Envoy straight to the same upstream.

One run starts one upstream (an Envoy answering like a tiny vLLM from ``direct_response``
on ``--endpoints`` ports), one Envoy-direct twin, and, per EPP under test, that EPP plus
its own gateway Envoy built from the same template (``build_envoy_config``): with GIE's
reference ``ORIGINAL_DST`` upstream (an EPP that serves no EDS runs too) and no gRPC
health check of the ext-proc port for another EPP, the product's (EDS pool cluster
fed by the EPP, gRPC health checks) for infergate's. EPPs under test:

* ``--variant NAME:ARGS`` (repeatable; default one ``infergate:``): ``infergate epp``
  with ``ARGS`` — leading ``KEY=VALUE`` words are its environment, the rest its flags
  (``--variant 'poll:GRPC_POLL_STRATEGY=poll'``, ``--variant 'aio:--grpc-server aio'``).
  ``--request-body-mode buffered|streamed`` among them configures that variant's Envoy
  (:attr:`EnvoyConfig.request_body_mode`); other EPPs' Envoys stream.
* ``--external NAME=COMMAND`` (repeatable): any other ext-proc EPP, started by the run;
  ``{grpc_port}``, ``{health_port}``, ``{metrics_port}``, ``{endpoints}`` (``host:port``
  list, comma-separated), ``{endpoints_file}`` (infergate's YAML) and
  ``{peer_config_file}`` (llm-d-router's EndpointPickerConfig with file discovery) are
  filled in. ``--external NAME=@HOST:PORT`` uses one already running (no CPU figure).
* ``--peer-binary PATH``: shorthand for llm-d-router's Go ``epp`` built by hand
  (docs/routing-lab/peer/README.md), run at its defaults, tracing off.

Per rate, ``--rounds`` rounds; each round loads every path once for ``--seconds`` with
the same seeded Poisson arrivals, in an order rotated per round, so machine load hits
all paths alike. Figures, median over rounds: added p50/p99 (path minus direct twin),
with the lowest and highest single round's next to each (ranges of two EPPs that overlap
mean their difference is within the noise between rounds);
CPU per request from /proc for the EPP process (and its children), minus its idle
CPU (measured in the same run while the other paths are loaded) and the load
average during the rate. ``--sustain-clients N`` then runs N closed-loop clients per EPP
for ``--seconds``: its sustained rate.

``--records``: the upstream echoes each request's ``x-infergate-request-id`` and the
client publishes that request's completion record once the response is read, on a
ZMQ PUB socket per upstream port, as the engines do (``RecordPublisher``). infergate's
EPPs then run as with real engines: requests end at their record, and a buffered EPP
skips the response headers (docs/epp.md, "Skipped response headers"). Other EPPs get no
records (their requests carry no key).

``--api chat`` sends chat bodies to ``/v1/chat/completions`` instead.

    .venv/bin/python benchmarks/epp_overhead.py --prompt-bytes 2048 --rates 100,300 --seconds 10 --rounds 3 \\
        --variant 'aio:' --variant 'sync:--grpc-server sync' [--peer-binary /tmp/llm-d-epp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from gateway_rig import (  # benchmarks/gateway_rig.py, beside this script
    RecordPublisher,
    body_of_size,
    closed_loop,
    open_loop,
    process_cpu_seconds,
    static_upstream_config,
)
from infergate.epp.options import EPP_PORTS, EppOptions

from infergate.bench.routing import external
from infergate.bench.routing.routers import direct_twin
from infergate.envoy.bootstrap import EnvoyConfig, build_envoy_config
from infergate.envoy.process import start_envoy
from infergate.procs import ProcessGroup, free_port
from infergate.stack.local import LOOPBACK, grpc_serving, infergate_argv


@dataclass
class Lane:
    """One loaded path: the direct twin (``pid`` None) or an EPP behind its gateway."""

    name: str
    url: str
    pid: int | None = None
    own_cpu: list[float] = field(default_factory=list)  # EPP CPU/request per round, ms
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    ok: int = 0
    sent: int = 0
    idle_cpu_s: float = 0.0  # EPP CPU while other paths were loaded
    idle_wall_s: float = 0.0


API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_body(api: str, prompt_bytes: int) -> dict[str, Any]:
    """The load's body: :func:`body_of_size`'s, or for ``chat`` the same prompt as the
    user's message after a short system message (what agents send)."""
    body = body_of_size(prompt_bytes)
    if api != "chat":
        return body
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": body["prompt"]},
    ]
    return {key: value for key, value in body.items() if key != "prompt"} | {"messages": messages}


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """``NAME:ARGS`` -> (name, environment, flags)."""
    name, _, rest = text.partition(":")
    env: dict[str, str] = {}
    words = shlex.split(rest)
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name or "infergate", env, words


#: Variant flags that configure the variant's gateway Envoy, not its EPP.
ENVOY_FLAGS = {"--request-body-mode": "request_body_mode"}


def envoy_overrides(flags: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split :data:`ENVOY_FLAGS` (``--flag value`` or ``--flag=value``) off ``flags``."""
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    words = iter(flags)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag in ENVOY_FLAGS:
            overrides[ENVOY_FLAGS[flag]] = value if eq else next(words, "")
        else:
            rest.append(word)
    return overrides, rest


def _tcp_ready(port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return True
        except OSError:
            return False

    return check


class Run:
    """The processes of one run (upstream, direct twin, EPPs and their gateways)."""

    def __init__(self, group: ProcessGroup, tmp: Path, args: argparse.Namespace) -> None:
        self.group, self.tmp, self.args = group, tmp, args
        self.ports = [free_port() for _ in range(args.endpoints)]
        start_envoy(
            group,
            static_upstream_config(self.ports, free_port()),
            tmp / "upstream.yaml",
            name="upstream",
        )
        self.records = RecordPublisher(self.ports) if args.records else None
        labels = self.records.labels if self.records is not None else {}
        self.endpoints_file = tmp / "endpoints.yaml"
        self.endpoints_file.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [
                        {"address": LOOPBACK, "port": p, "labels": labels.get(p, {})}
                        for p in self.ports
                    ]
                }
            )
        )
        self.peer_config = tmp / "peer-config.yaml"
        peer_endpoints = tmp / "peer-endpoints.yaml"
        addresses = [f"{LOOPBACK}:{p}" for p in self.ports]
        peer_endpoints.write_text(yaml.safe_dump(external.endpoints_document(addresses)))
        self.peer_config.write_text(
            yaml.safe_dump(
                external.with_file_discovery(external.load_config(None), peer_endpoints),
                sort_keys=False,
            )
        )
        self.envoy_overrides: dict[str, dict[str, Any]] = {}
        self.paths: list[Lane] = [Lane("direct", self._gateway("direct", 0, direct=True))]

    def _envoy_config(
        self, listen: int, epp_port: int, ours: bool, name: str = ""
    ) -> dict[str, Any]:
        """infergate's EPP gets the product's template (EDS pool, gRPC health checks of
        the ext-proc port); another EPP the same with GIE's reference ORIGINAL_DST
        upstream and no health check (it serves neither EDS nor health on that port)."""
        return build_envoy_config(
            EnvoyConfig(
                listen_port=listen,
                admin_port=free_port(),
                listen_address=LOOPBACK,
                epp_address=LOOPBACK,
                epp_port=epp_port or 1,
                upstream="eds" if ours else "original_dst",
                fallback_endpoints=[(LOOPBACK, p) for p in self.ports],
                access_log=False,
                response_accounting=self.args.accounting,
                epp_health_check_interval_s=1.0 if ours else None,
                **self.envoy_overrides.get(name, {}),
            )
        )

    def _gateway(self, name: str, epp_port: int, direct: bool = False, ours: bool = False) -> str:
        listen = free_port()
        config = self._envoy_config(listen, epp_port, ours or direct, name)
        start_envoy(
            self.group,
            direct_twin(config) if direct else config,
            self.tmp / f"envoy-{name}.yaml",
            name=f"envoy-{name}",
        )
        return f"http://{LOOPBACK}:{listen}{API_PATHS[self.args.api]}"

    def add_infergate(self, text: str) -> None:
        name, env, flags = parse_variant(text)
        self.envoy_overrides[name], flags = envoy_overrides(flags)
        grpc, health, metrics = free_port(), free_port(), free_port()
        options = EppOptions(
            endpoints_file=self.endpoints_file, host=LOOPBACK, log_level="warning",
            grpc_port=grpc, grpc_health_port=health, metrics_port=metrics,
        )  # fmt: skip
        argv = [*infergate_argv(), *options.argv(always=EPP_PORTS), *flags]
        process = self.group.start(
            f"epp-{name}",
            argv,
            ready=grpc_serving(LOOPBACK, health),
            timeout=120,
            env={**os.environ, **env},
        )
        self.paths.append(Lane(name, self._gateway(name, grpc, ours=True), process.pid))

    def add_external(self, text: str) -> None:
        name, _, command = text.partition("=")
        if command.startswith("@"):
            host, _, port = command[1:].rpartition(":")
            if host not in (LOOPBACK, "localhost"):
                raise SystemExit("--external NAME=@HOST:PORT: the gateway dials 127.0.0.1")
            self.paths.append(Lane(name, self._gateway(name, int(port))))
            return
        grpc, health, metrics = free_port(), free_port(), free_port()
        argv = [
            word.format(
                grpc_port=grpc,
                health_port=health,
                metrics_port=metrics,
                endpoints=",".join(f"{LOOPBACK}:{p}" for p in self.ports),
                endpoints_file=self.endpoints_file,
                peer_config_file=self.peer_config,
            )
            for word in shlex.split(command)
        ]
        ready = grpc_serving(LOOPBACK, health) if "{health_port}" in command else _tcp_ready(grpc)
        process = self.group.start(f"epp-{name}", argv, ready=ready, timeout=120)
        time.sleep(2.0)  # its first scrapes of the endpoints
        self.paths.append(Lane(name, self._gateway(name, grpc), process.pid))

    def add_peer(self, binary: Path) -> None:
        argv = external.epp_argv(
            binary,
            Path("{peer_config_file}"),
            grpc_port=0,
            health_port=0,
            metrics_port=0,
        )
        for flag, key in (
            ("--grpc-port", "grpc_port"),
            ("--grpc-health-port", "health_port"),
            ("--metrics-port", "metrics_port"),
        ):
            argv[argv.index(flag) + 1] = "{" + key + "}"
        self.add_external("llm-d-router=" + shlex.join(argv))


def _cpu(pid: int | None) -> float:
    return process_cpu_seconds(pid) if pid is not None else 0.0


def run_rate(run: Run, rate: float, body: dict[str, Any], args: argparse.Namespace) -> None:
    """``--rounds`` rounds at ``rate``; fills each path's per-round figures."""
    paths = run.paths
    for round_index in range(args.rounds):
        shift = round_index % len(paths)
        for path in paths[shift:] + paths[:shift]:
            before = {p.name: _cpu(p.pid) for p in paths}
            started = time.monotonic()
            result = asyncio.run(
                open_loop(
                    path.url,
                    rate,
                    args.seconds,
                    seed=round_index,
                    body=body,
                    on_response=run.records,
                )
            )
            wall = time.monotonic() - started
            for other in paths:
                spent = _cpu(other.pid) - before[other.name]
                if other is path:
                    own = spent
                else:
                    other.idle_cpu_s += spent
                    other.idle_wall_s += wall
            path.p50.append(result["p50_ms"])
            path.p99.append(result["p99_ms"])
            path.ok += int(result["ok"])
            path.sent += int(result["sent"])
            if path.pid is not None:
                idle = path.idle_cpu_s / path.idle_wall_s if path.idle_wall_s else 0.0
                served = int(result["ok"]) + 50  # the 50 warm-up requests went through too
                path.own_cpu.append((own - idle * wall) * 1000 / served)
            print(
                f"{rate:>6.0f} {path.name:>14} {int(result['ok']):>5}/{int(result['sent']):<5} "
                f"p50 {result['p50_ms']:>7.2f}  p99 {result['p99_ms']:>8.2f}  "
                f"lag99 {result['send_lag_p99_ms']:>6.2f}  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )


def _spread(path: list[float], direct: list[float]) -> str:
    """The lowest and highest added latency of single rounds (a round's path minus that
    round's direct twin): two EPPs whose ranges overlap differ by less than the noise
    between rounds on this machine."""
    added = [p - d for p, d in zip(path, direct, strict=False)]
    return f"{min(added):.2f}..{max(added):.2f}" if len(added) > 1 else "-"


def report(run: Run, rate: float, loads: tuple[float, float]) -> list[str]:
    direct = run.paths[0]
    lines = []
    for path in run.paths[1:]:
        p50 = statistics.median(path.p50) - statistics.median(direct.p50)
        p99 = statistics.median(path.p99) - statistics.median(direct.p99)
        cpu = f"{statistics.median(path.own_cpu):.2f}" if path.own_cpu else "-"
        idle = path.idle_cpu_s / path.idle_wall_s if path.idle_wall_s else 0.0
        lines.append(
            f"{rate:>6.0f} {path.name:>14} {path.ok:>6}/{path.sent:<6} {p50:>8.2f} "
            f"{_spread(path.p50, direct.p50):>12} {p99:>8.2f} {_spread(path.p99, direct.p99):>12} "
            f"{cpu:>9} {idle:>9.3f}   {loads[0]:.1f}-{loads[1]:.1f}"
        )
    return lines


def sustained(run: Run, body: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Each path under ``--sustain-clients`` closed-loop clients: its sustained rate."""
    lines = []
    for path in run.paths:
        before = _cpu(path.pid)
        result = asyncio.run(
            closed_loop(path.url, args.sustain_clients, args.seconds, body, run.records)
        )
        cpu = (_cpu(path.pid) - before) * 1000 / max(1.0, result["rps"] * args.seconds + 50)
        lines.append(
            f"{path.name:>14} {result['rps']:>8.0f} req/s  failures {int(result['failures'])}  "
            f"p50 {result['p50_ms']:.2f} ms  p99 {result['p99_ms']:.2f} ms  "
            f"EPP CPU {cpu:.2f} ms/req  load {os.getloadavg()[0]:.1f}"
        )
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100,300", help="requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="per path, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--prompt-bytes", type=int, default=2048, help="0: a 7-byte prompt")
    parser.add_argument(
        "--api",
        default="completions",
        choices=sorted(API_PATHS),
        help="the body's API: a completions 'prompt', or chat 'messages' (a system and a "
        "user message, the prompt's bytes in the user's)",
    )
    parser.add_argument(
        "--accounting",
        default="engine",
        choices=["engine", "observer", "body", "none"],
        help="build_envoy_config's response_accounting, the same for every EPP",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:[ENV=V ...] FLAGS (an infergate EPP; --request-body-mode goes to its Envoy)",
    )
    parser.add_argument("--external", action="append", default=[], help="NAME=COMMAND|@HOST:PORT")
    parser.add_argument("--peer-binary", type=Path, help="llm-d-router's epp, built by hand")
    parser.add_argument("--sustain-clients", type=int, default=0, help="0: skip")
    parser.add_argument(
        "--records",
        action="store_true",
        help="publish a completion record per response to infergate's EPPs, as engines do "
        "(RecordPublisher): what lets a buffered EPP skip the response headers",
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; {args.endpoints} endpoints, accounting "
        f"{args.accounting}, {args.api} prompt {args.prompt_bytes} B, {args.rounds} rounds x "
        f"{args.seconds:g} s per path" + (", completion records published" if args.records else "")
    )
    body = request_body(args.api, args.prompt_bytes)
    out = []
    with ProcessGroup() as group, tempfile.TemporaryDirectory() as tmp:
        run = Run(group, Path(tmp), args)
        for variant in args.variant or ["infergate:"]:
            run.add_infergate(variant)
        for text in args.external:
            run.add_external(text)
        if args.peer_binary is not None:
            run.add_peer(args.peer_binary)
        for rate in rates:
            for path in run.paths:
                path.own_cpu, path.p50, path.p99, path.ok, path.sent = [], [], [], 0, 0
                path.idle_cpu_s = path.idle_wall_s = 0.0
            load_before = os.getloadavg()[0]
            run_rate(run, rate, body, args)
            out += report(run, rate, (load_before, os.getloadavg()[0]))
        sustain = sustained(run, body, args) if args.sustain_clients else []
        if run.records is not None:
            print(f"completion records published: {run.records.sent}")
            run.records.close()
    print(
        "\nadded latency = path minus direct twin (median of rounds; rounds: the lowest and "
        "highest single round's); CPU minus idle"
    )
    print(
        f"{'rate':>6} {'EPP':>14} {'ok/sent':>13} {'p50 +ms':>8} {'rounds':>12} {'p99 +ms':>8} "
        f"{'rounds':>12} {'CPU ms/req':>9} {'idle cores':>9}   load"
    )
    print("\n".join(out))
    if sustain:
        print(f"\nsustained, {args.sustain_clients} closed-loop clients, {args.seconds:g} s:")
        print("\n".join(sustain))


if __name__ == "__main__":
    main()
