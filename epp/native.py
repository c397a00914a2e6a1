"""The EPP's native modules, loaded under one fallback policy.

Both are Rust crates built by cargo at install time (``setup.py``) and optional, so an
install without a Rust toolchain (the engine and operator images) still works:

- ``infergate.epp._grpc_h2`` (``native/grpc_h2``): HTTP/2 for ``--grpc-server h2``;
  without it ext-proc is served by grpc.aio.
- ``infergate.epp.scheduling._prefix_index`` (``native/prefix_index``): the prefix
  scorer's index and block hashing (loaded by ``scheduling/prefix_index.py``); without
  it the scorer uses the Python index there.

Why one policy: a fallback keeps the EPP correct but costs CPU per request, so it must
not pass silently, nor be said differently by each caller. :func:`load_native` is the one
way to load them: a missing module is one warning per process that names what is lost
and how to build it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

BUILD_HINT = "install cargo (Rust >= 1.85) and reinstall infergate to build it"


def crate_of(name: str) -> str:
    """The crate a native module is built from: ``infergate.epp._grpc_h2`` -> ``native/grpc_h2``."""
    return "native/" + name.rsplit(".", 1)[-1].lstrip("_")


@functools.cache
def load_native(name: str, fallback: str) -> ModuleType | None:
    """The native module ``name``, or None when it cannot be loaded; then one warning
    (once per process: the result is cached) says ``fallback``, what runs instead and
    what that costs, and how to build the module."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        log.warning(
            "the native module %s (%s) is not available (%s): %s; %s",
            name,
            crate_of(name),
            error,
            fallback,
            BUILD_HINT,
        )
        return None
