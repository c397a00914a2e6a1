"""``--endpoint HOST:PORT`` (repeatable): a fixed pool."""

from __future__ import annotations

from infergate.epp.types import Endpoint


def parse_endpoint(text: str) -> Endpoint:
    """``10.0.0.7:8000`` or ``[fd00::7]:8000`` → Endpoint; ValueError names the problem."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {text!r} is not HOST:PORT")
    return Endpoint(host, int(port))
