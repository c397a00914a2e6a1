"""The EPP's native modules fall back under one policy (``infergate.epp.native``): a
module that cannot be loaded is one warning per process, naming what runs instead and
how to build it; the EPP still serves. Both fallbacks (the h2 transport and the prefix
index) are checked in a fresh interpreter where the native module is blocked."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
from infergate.epp.native import BUILD_HINT, crate_of, load_native


def test_a_missing_module_is_one_warning_naming_the_fallback_and_the_build(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "infergate.epp._no_such_native"
    with caplog.at_level(logging.WARNING, logger="infergate.epp.native"):
        assert load_native(name, "doing it in Python") is None
        assert load_native(name, "doing it in Python") is None
    (record,) = caplog.records
    message = record.getMessage()
    assert name in message and "native/no_such_native" in message
    assert "doing it in Python" in message and BUILD_HINT in message


def test_a_built_module_loads_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="infergate.epp.native"):
        assert load_native("json", "unused") is sys.modules["json"]
    assert not caplog.records


def test_the_crate_is_named_after_the_module() -> None:
    assert crate_of("infergate.epp._grpc_h2") == "native/grpc_h2"
    assert crate_of("infergate.epp.scheduling._prefix_index") == "native/prefix_index"


def _without(module: str, code: str) -> str:
    """Runs ``code`` in a fresh interpreter where ``module`` cannot be imported (as in an
    install without cargo); its stderr (the log) and stdout, together."""
    script = f"import sys\nsys.modules[{module!r}] = None\n" + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_the_prefix_index_falls_back_to_python_with_the_warning() -> None:
    out = _without(
        "infergate.epp.scheduling._prefix_index",
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        from infergate.epp.scheduling import prefix_index
        from infergate.epp.scheduling.plugins import prefix
        assert prefix_index.native is None
        assert prefix_index.PrefixIndex is prefix_index.PythonPrefixIndex
        assert prefix.PrefixIndex is prefix_index.PythonPrefixIndex  # the scorer's
        print("python index")
        """,
    )
    assert "python index" in out
    (line,) = [x for x in out.splitlines() if "native/prefix_index" in x]
    assert "Python index" in line and BUILD_HINT in line


def test_the_h2_transport_falls_back_to_grpc_aio_with_the_warning() -> None:
    out = _without(
        "infergate.epp._grpc_h2",
        """
        import asyncio, logging
        logging.basicConfig(level=logging.WARNING)
        from infergate.epp.app import Epp
        from infergate.epp.options import EppOptions
        from infergate.epp.types import Endpoint

        async def main() -> None:
            epp = Epp(EppOptions(static_endpoints=[Endpoint("127.0.0.1", 9)], host="127.0.0.1",
                                 grpc_port=0, grpc_health_port=0, metrics_port=0,
                                 grpc_server="h2"))
            await epp.start()
            try:
                assert epp._grpc is not None and epp._h2 is None and epp.grpc_port > 0
                print("served by grpc.aio")
            finally:
                await epp.stop(0)

        asyncio.run(main())
        """,
    )
    assert "served by grpc.aio" in out
    (line,) = [x for x in out.splitlines() if "native/grpc_h2" in x]
    assert "grpc.aio" in line and BUILD_HINT in line
