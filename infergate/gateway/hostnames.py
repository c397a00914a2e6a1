"""Gateway API hostnames: validity, wildcard matching, intersection and specificity.

A hostname is an RFC 1123 name, optionally prefixed by the wildcard label ``*.``, which
matches one or more labels (``*.example.com`` matches ``a.example.com`` and
``a.b.example.com``, not ``example.com``) — the same as an Envoy ``*.example.com``
virtual-host domain, so a hostname is used as a domain unchanged. ``ANY`` stands for "no
hostname" (a listener or route that matches every host): Envoy's ``*`` domain.
"""

from __future__ import annotations

import ipaddress
import re

ANY = "*"

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def valid(hostname: str) -> bool:
    """An RFC 1123 hostname (not an IP), optionally with a leading ``*.`` label."""
    if not hostname or len(hostname) > 253 or hostname.endswith("."):
        return False
    name = hostname[2:] if hostname.startswith("*.") else hostname
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        return False
    return all(_LABEL.match(label) and len(label) <= 63 for label in name.split("."))


def is_wildcard(hostname: str) -> bool:
    return hostname.startswith("*.")


def covers(pattern: str, hostname: str) -> bool:
    """Whether every host ``hostname`` stands for is also matched by ``pattern``."""
    if pattern in (ANY, hostname):
        return True
    if hostname == ANY or not is_wildcard(pattern):
        return False
    suffix = pattern[1:]  # ".example.com"
    name = hostname[1:] if is_wildcard(hostname) else hostname
    return name.endswith(suffix) and len(name) > len(suffix)


def covering(hostname: str) -> list[str]:
    """Every hostname that :func:`covers` ``hostname``: itself, the wildcards of its
    parent domains, and ``ANY`` (so lookups need not scan every hostname)."""
    name = hostname[1:] if is_wildcard(hostname) else hostname
    out = [hostname, ANY]
    for i, ch in enumerate(name):
        if ch == "." and i > 0:
            out.append("*" + name[i:])
    return out


def intersect(listener: str, route: str) -> str | None:
    """The hostnames both stand for, as one hostname (the more specific), or None."""
    if covers(listener, route):
        return route
    if covers(route, listener):
        return listener
    return None


def effective(listener: str, route_hostnames: list[str]) -> list[str]:
    """The hostnames a route serves through a listener (``ANY`` for each side that has
    none); empty when both specify hostnames and none intersect."""
    wanted = route_hostnames or [ANY]
    out: list[str] = []
    for hostname in wanted:
        both = intersect(listener, hostname)
        if both is not None and both not in out:
            out.append(both)
    return out


def specificity(hostname: str) -> tuple[int, int, int]:
    """Sort key, higher is more specific: exact before wildcard before ``ANY``, then
    more labels, then more characters (Gateway API's listener and route precedence)."""
    if hostname == ANY:
        return (0, 0, 0)
    exact = 0 if is_wildcard(hostname) else 1
    return (1 + exact, hostname.count("."), len(hostname))


def route_precedence(hostname: str) -> tuple[int, int]:
    """HTTPRoute hostname precedence: characters of a matching non-wildcard hostname,
    then characters of a matching hostname."""
    if hostname == ANY:
        return (0, 0)
    return (0 if is_wildcard(hostname) else len(hostname), len(hostname))
