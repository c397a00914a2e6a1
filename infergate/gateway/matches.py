"""HTTPRoute matches → Envoy route matches, with Gateway API precedence.

Envoy rejects a whole RouteConfiguration when one route in it is malformed (a regex RE2
cannot compile, a header name with a newline), and a rejected RDS update would freeze
every route of the Gateway. So everything that reaches Envoy is validated here first;
what fails makes its rule invalid (a status condition), never a NACK.

Regular expressions (path, header and query-param matches) are RE2, matched against the
whole value. Their precedence is implementation-specific in Gateway API; here a
RegularExpression path ranks after Exact and before PathPrefix, longer patterns first.
"""

from __future__ import annotations

import re
import re._parser as _sre_parser  # the stdlib's own regex parser, for the size estimate
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infergate.gateway.model import as_dict, as_list, as_str

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
_PATH_CHARS = re.compile(r"^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})+$")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$")
# Python-only regex syntax RE2 rejects: lookaround, backreferences, conditionals,
# possessive quantifiers, \Z. (Erring on the side of rejecting.)
_NOT_RE2 = re.compile(r"\(\?[=!<>]|\(\?P=|\\[1-9]|\(\?\(|\\Z|[*+?}]\+")
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_INLINE_FLAGS = re.compile(r"\(\?([A-Za-z-]+)[:)]")
_DURATION = re.compile(r"^([0-9]{1,5}(h|ms|m|s)){1,4}$")
_DURATION_PART = re.compile(r"([0-9]{1,5})(h|ms|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
REGEX_PROGRAM_LIMIT = 20000
"""Regexes estimated above this many RE2 steps are refused (a condition, not a NACK):
far below what RE2's memory budget can compile. Envoy's own default limit is 100, so
the Gateway's Envoy must raise ``re2.max_program_size.error_level`` (see
:data:`infergate.gateway.static.GATEWAY_RUNTIME`)."""


class Invalid(ValueError):
    """A value the translator cannot program; the message goes into a condition."""


@dataclass(frozen=True)
class Match:
    """One compiled HTTPRouteMatch: Envoy's ``match`` and its precedence sort key
    (ascending sorts the winning match first)."""

    envoy: dict[str, Any]
    precedence: tuple[int, int, int, int, int]
    prefix: str | None  # the PathPrefix value, for ReplacePrefixMatch rewrites


def compile_match(match: dict[str, Any]) -> Match:
    path = as_dict(match.get("path"))
    kind = as_str(path.get("type"), "PathPrefix")
    value = as_str(path.get("value"), "/")
    envoy: dict[str, Any] = _path_match(kind, value)
    headers = _headers(match.get("headers"))
    header_count = len(headers)
    method = match.get("method")
    if method is not None:
        if method not in METHODS:
            raise Invalid(f"unsupported method {method!r}")
        headers.append({"name": ":method", "string_match": {"exact": method}})
    if headers:
        envoy["headers"] = headers
    query = _query_params(match.get("queryParams"))
    if query:
        envoy["query_parameters"] = query
    rank = {"Exact": 0, "RegularExpression": 1, "PathPrefix": 2}[kind]
    precedence = (
        rank,
        -len(value),
        0 if method is not None else 1,
        -header_count,
        -len(query),
    )
    return Match(envoy, precedence, value if kind == "PathPrefix" else None)


def _path_match(kind: str, value: str) -> dict[str, Any]:
    if kind == "RegularExpression":
        return {"safe_regex": {"regex": check_regex(value)}}
    if kind not in ("Exact", "PathPrefix"):
        raise Invalid(f"unsupported path match type {kind!r}")
    check_path(value)
    if kind == "Exact":
        return {"path": value}
    trimmed = value.rstrip("/")
    # Element-wise prefix: /abc matches /abc, /abc/ and /abc/def, not /abcd.
    return {"prefix": "/"} if not trimmed else {"path_separated_prefix": trimmed}


def check_path(value: str) -> str:
    """An Exact/PathPrefix value as the Gateway API CRD allows it."""
    bad = ("//", "/./", "/../", "%2f", "%2F", "#")
    if (
        not value.startswith("/")
        or len(value) > 1024
        or not _PATH_CHARS.match(value)
        or any(b in value for b in bad)
        or value.endswith(("/..", "/."))
    ):
        raise Invalid(f"invalid path {value!r}")
    return value


def check_regex(pattern: str) -> str:
    """A pattern RE2 (Envoy's regex engine) accepts, as far as can be told without it."""
    if not pattern or len(pattern) > 1024 or _NOT_RE2.search(pattern):
        raise Invalid(f"unsupported regular expression {pattern!r} (RE2 syntax)")
    for low, high in _REPEAT.findall(pattern):
        if int(low) > 1000 or (high and int(high) > 1000):
            raise Invalid(f"repetition over 1000 in {pattern!r}")
    for flags in _INLINE_FLAGS.findall(pattern):
        if set(flags) - set("imsU-"):
            raise Invalid(f"unsupported regex flags in {pattern!r}")
    if any(ch in pattern for ch in "\x00\r\n"):
        raise Invalid("control characters in regular expression")
    try:
        re.compile(pattern)
        size = _program_size(_sre_parser.parse(pattern))
    except (re.error, OverflowError, RecursionError) as error:
        raise Invalid(f"invalid regular expression {pattern!r}: {error}") from None
    if size > REGEX_PROGRAM_LIMIT:
        raise Invalid(f"regular expression {pattern!r} is too large (about {size} RE2 steps)")
    return pattern


def _program_size(parsed: Any) -> int:
    """A generous estimate of RE2's program size for a parsed pattern: bounded repeats
    are unrolled (as RE2 does), a character class costs one step per range."""
    total = 0
    for op, arg in parsed:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            body = _program_size(sub) + 1
            copies = low + 1 if high == _sre_parser.MAXREPEAT else max(high, 1)
            total += body * copies
        elif name == "SUBPATTERN":
            total += _program_size(arg[-1]) + 2
        elif name == "BRANCH":
            total += sum(_program_size(b) + 1 for b in arg[1])
        elif name == "IN":
            total += len(arg) + 1
        else:
            total += 1
    return total


def check_header_name(name: Any) -> str:
    if not isinstance(name, str) or not _HEADER_NAME.match(name) or len(name) > 256:
        raise Invalid(f"invalid header name {name!r}")
    return name


def check_header_value(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 4096 or any(c in value for c in "\x00\r\n"):
        raise Invalid(f"invalid header value {value!r}")
    return value


def _string_match(kind: str, value: Any) -> dict[str, Any]:
    if kind == "Exact":
        return {"exact": check_header_value(value)}
    if kind == "RegularExpression":
        return {"safe_regex": {"regex": check_regex(check_header_value(value))}}
    raise Invalid(f"unsupported match type {kind!r}")


def _headers(raw: Any) -> list[dict[str, Any]]:
    """Header matches; of several with one (case-insensitive) name, the first counts."""
    return _named_matches(raw, str.lower)


def _query_params(raw: Any) -> list[dict[str, Any]]:
    """Query-param matches; of several with one (exact) name, the first counts."""
    return _named_matches(raw, str)


def _named_matches(raw: Any, key: Callable[[str], str]) -> list[dict[str, Any]]:
    """Name/value matches (Gateway API's header and query-param shape), names checked and
    normalised by ``key``; of several with one normalised name, the first counts."""
    out, seen = [], set()
    for item in map(as_dict, as_list(raw)):
        name = key(check_header_name(item.get("name")))
        if name in seen:
            continue
        seen.add(name)
        kind = as_str(item.get("type"), "Exact")
        out.append({"name": name, "string_match": _string_match(kind, item.get("value"))})
    return out


def parse_duration(text: Any) -> float:
    """A Gateway API Duration (``1h``, ``500ms``, ``1m30s``) in seconds."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise Invalid(f"invalid duration {text!r}")
    return sum(int(n) * _UNITS[unit] for n, unit in _DURATION_PART.findall(text))
