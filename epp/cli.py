"""``infergate epp``: the Endpoint Picker."""

from typing import Any, NoReturn

import typer
from infergate.epp.gie_flags import gie_flags_help
from infergate.epp.options import EppOptions, parse_duration

from infergate.options import command

__all__ = ["epp", "parse_duration"]

HELP = """Run the Envoy ext-proc Endpoint Picker (EPP) for a pool of engine endpoints.

Envoy streams each request to the EPP (gRPC on --grpc-port, FULL_DUPLEX_STREAMED bodies);
the EPP answers with the header `x-gateway-destination-endpoint: ip:port` (and the same
value as dynamic metadata `envoy.lb`) chosen from live engine metrics and prefix-cache
affinity.

Pick exactly one endpoint source:

* `--endpoint 127.0.0.1:8000 --endpoint 127.0.0.1:8001` — a fixed list;

* `--endpoints endpoints.yaml` — `endpoints: [{address, port, labels}]`, hot-reloaded;

* `--pool-name NAME [--pool-namespace NS]` — watch an InferencePool in Kubernetes.

Scheduling is configured by an EndpointPickerConfig (`--config-file`, GIE's format);
without one: queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3,
max-score-picker. See docs/epp.md.
"""


@command(EppOptions)
def epp(options: EppOptions) -> None:
    """Run the Envoy ext-proc Endpoint Picker for a pool of engine endpoints."""
    import logging

    logging.basicConfig(
        level=getattr(logging, options.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sources = (options.pool_name, options.endpoints_file, options.static_endpoints)
    if sum(bool(source) for source in sources) != 1:
        _fail("give exactly one of --pool-name, --endpoints FILE, --endpoint HOST:PORT")
    if options.client_ca_file is not None and not options.secure_serving:
        _fail("--client-ca-file needs --secure-serving (client certificates are a TLS feature)")
    _validate(options)
    if options.workers > 1:
        _run_workers(options)
    _run(options)


def gie_args(args: list[str]) -> list[str]:
    """GIE's and llm-d-router's EPP flags (epp/gie_flags.py) rewritten as ours; a flag
    asking for what infergate cannot do is a usage error naming it."""
    from infergate.epp.gie_flags import GieArgsError, normalize

    try:
        rewritten, notes = normalize(args)
    except GieArgsError as error:  # before click runs: no typer.Exit handler yet
        typer.echo(f"infergate epp: {error}", err=True)
        raise SystemExit(2) from None
    for note in notes:
        typer.echo(f"infergate epp: {note}", err=True)
    return rewritten


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"infergate epp: {message}", err=True)
    raise typer.Exit(code)


def _validate(options: EppOptions) -> None:
    """Build the EPP once without binding: plugins, parameters and files are checked and a
    bad one is one line, before any port is taken."""
    from infergate.epp.app import Epp
    from infergate.epp.config import ConfigError
    from infergate.epp.datalayer.discovery.file import EndpointsFileError
    from infergate.epp.datalayer.objectives import ObjectivesError

    try:
        Epp(options)
    except (ConfigError, EndpointsFileError, ObjectivesError) as error:
        _fail(f"invalid configuration: {error}")


def _run_workers(options: EppOptions) -> NoReturn:
    """``--workers N``: N copies of this command line behind one port (epp/workers.py)."""
    import sys

    from infergate.epp.workers import run_workers

    if options.grpc_port == 0 or options.grpc_health_port == 0:
        _fail("--workers needs fixed --grpc-port and --grpc-health-port")
    raise typer.Exit(run_workers(sys.argv[1:], options.workers, options.metrics_port))


def _run(options: EppOptions) -> None:
    import asyncio

    from infergate.epp.app import run

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run(options))
    except OSError as error:
        _fail(str(error), code=1)


def _loop_factory() -> Any:
    """uvloop when installed (it ships with uvicorn[standard]): a cheaper event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


epp.__doc__ = f"{HELP}\n{gie_flags_help()}\n"
