"""HTTPRoute filters → Envoy route settings.

Supported: RequestHeaderModifier, ResponseHeaderModifier (on rules and on backendRefs),
RequestRedirect and URLRewrite. Any other filter (RequestMirror, CORS, ExtensionRef,
ExternalAuth, unknown types) makes its rule invalid: the spec forbids skipping a filter,
so the requests it matches get a 500 rather than unfiltered service.

Header values are literal in Gateway API but format strings in Envoy, so ``%`` is
escaped. The headers the endpoint picker protocol relies on cannot be modified: a route
could otherwise choose the pool member itself.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from infergate.envoy.bootstrap import header_value_option
from infergate.gateway.matches import (
    Invalid,
    check_header_name,
    check_header_value,
    check_path,
)
from infergate.gateway.model import as_dict, as_int, as_list, as_str
from infergate.wire.names import (
    DESTINATION_HEADER,
    PREFIX_HEADER,
    REQUEST_ID_HEADER,
    SERVED_HEADER,
    SUBSET_KEY,
)

RESERVED_HEADERS = frozenset(
    h.lower()
    for h in (DESTINATION_HEADER, SERVED_HEADER, REQUEST_ID_HEADER, PREFIX_HEADER, SUBSET_KEY)
)
REDIRECT_CODES = {
    301: "MOVED_PERMANENTLY",
    302: "FOUND",
    303: "SEE_OTHER",
    307: "TEMPORARY_REDIRECT",
    308: "PERMANENT_REDIRECT",
}
SUPPORTED = ("RequestHeaderModifier", "ResponseHeaderModifier", "RequestRedirect", "URLRewrite")
BACKEND_SUPPORTED = ("RequestHeaderModifier", "ResponseHeaderModifier")
_MODIFIER_FIELD = {
    "RequestHeaderModifier": "requestHeaderModifier",
    "ResponseHeaderModifier": "responseHeaderModifier",
}


@dataclass
class Headers:
    """Envoy's header-mutation fields of a route (or a weighted cluster)."""

    request_add: list[dict[str, Any]] = field(default_factory=list)
    request_remove: list[str] = field(default_factory=list)
    response_add: list[dict[str, Any]] = field(default_factory=list)
    response_remove: list[str] = field(default_factory=list)
    host: str | None = None

    def apply(self, target: dict[str, Any]) -> None:
        """Set the non-empty fields on an Envoy Route or ClusterWeight."""
        for key, value in (
            ("request_headers_to_add", self.request_add),
            ("request_headers_to_remove", self.request_remove),
            ("response_headers_to_add", self.response_add),
            ("response_headers_to_remove", self.response_remove),
        ):
            if value:
                target[key] = target.get(key, []) + copy.deepcopy(value)


@dataclass
class RuleFilters:
    """A rule's filters, compiled."""

    headers: Headers = field(default_factory=Headers)
    redirect: dict[str, Any] | None = None
    rewrite: dict[str, Any] = field(default_factory=dict)


def compile_rule_filters(raw: Any, prefix: str | None, single_match: bool) -> RuleFilters:
    """The rule's ``filters``; ``prefix`` is its PathPrefix value when it has exactly one
    match (ReplacePrefixMatch needs it). Raises :class:`Invalid`."""
    out = RuleFilters()
    seen: set[str] = set()
    for f in map(as_dict, as_list(raw)):
        kind = as_str(f.get("type"))
        if kind not in SUPPORTED:
            raise Invalid(f"filter type {kind!r} is not supported")
        if kind in seen:
            raise Invalid(f"filter {kind} is repeated")
        seen.add(kind)
        if kind in _MODIFIER_FIELD:
            _modifier(out.headers, kind, as_dict(f.get(_MODIFIER_FIELD[kind])))
        elif kind == "RequestRedirect":
            out.redirect = _redirect(as_dict(f.get("requestRedirect")), prefix, single_match)
        else:
            out.rewrite = _rewrite(as_dict(f.get("urlRewrite")), prefix, single_match)
    if out.redirect is not None and "URLRewrite" in seen:
        raise Invalid("RequestRedirect and URLRewrite cannot be combined")
    return out


def compile_backend_filters(raw: Any) -> Headers:
    """A backendRef's ``filters``: header modifiers only. Raises :class:`Invalid`."""
    headers = Headers()
    seen: set[str] = set()
    for f in map(as_dict, as_list(raw)):
        kind = as_str(f.get("type"))
        if kind not in BACKEND_SUPPORTED or kind in seen:
            raise Invalid(f"backendRef filter {kind!r} is not supported")
        seen.add(kind)
        _modifier(headers, kind, as_dict(f.get(_MODIFIER_FIELD[kind])))
    if headers.host is not None:
        raise Invalid("a backendRef filter cannot set the Host header")
    return headers


def _modifier(headers: Headers, kind: str, spec: dict[str, Any]) -> None:
    request = kind == "RequestHeaderModifier"
    adds = headers.request_add if request else headers.response_add
    removes = headers.request_remove if request else headers.response_remove
    for action, append in (
        ("set", "OVERWRITE_IF_EXISTS_OR_ADD"),
        ("add", "APPEND_IF_EXISTS_OR_ADD"),
    ):
        for item in map(as_dict, as_list(spec.get(action))):
            name = _modifiable(item.get("name"))
            value = check_header_value(item.get("value"))
            if name.lower() == "host":
                if not request:
                    raise Invalid("the Host header cannot be modified on responses")
                headers.host = value
                continue
            option = header_value_option(name, value.replace("%", "%%"))
            option["append_action"] = append
            adds.append(option)
    for name in as_list(spec.get("remove")):
        name = _modifiable(name)
        if name.lower() == "host":
            raise Invalid("the Host header cannot be removed")
        removes.append(name)


def _modifiable(name: Any) -> str:
    name = check_header_name(name)
    if name.lower() in RESERVED_HEADERS:
        raise Invalid(f"header {name} is reserved for the endpoint picker protocol")
    return name


def _redirect(spec: dict[str, Any], prefix: str | None, single_match: bool) -> dict[str, Any]:
    """Envoy RedirectAction; the port is settled per listener by :func:`redirect_port`."""
    out: dict[str, Any] = {}
    scheme = spec.get("scheme")
    if scheme is not None:
        if scheme not in ("http", "https"):
            raise Invalid(f"unsupported redirect scheme {scheme!r}")
        out["scheme_redirect"] = scheme
    hostname = spec.get("hostname")
    if hostname is not None:
        out["host_redirect"] = check_header_value(hostname)
    code = as_int(spec.get("statusCode")) if "statusCode" in spec else 302
    if code not in REDIRECT_CODES:
        raise Invalid(f"unsupported redirect status code {spec.get('statusCode')!r}")
    out["response_code"] = REDIRECT_CODES[code]
    port = as_int(spec.get("port"))
    if spec.get("port") is not None and (port is None or not 0 < port < 65536):
        raise Invalid(f"invalid redirect port {spec.get('port')!r}")
    out["@port"] = port
    out.update(_path_modifier(as_dict(spec.get("path")), prefix, single_match, redirect=True))
    return out


def redirect_port(redirect: dict[str, Any], listener_port: int) -> dict[str, Any]:
    """Finish a redirect for one listener port: an explicit port, else the scheme's
    well-known port, else the listener's; a port that is the scheme's default is left
    out of ``Location``, as the spec asks."""
    out = {k: v for k, v in redirect.items() if k != "@port"}
    scheme = out.get("scheme_redirect")
    port = redirect.get("@port")
    if port is None:
        port = {"http": 80, "https": 443}.get(scheme or "", listener_port)
    default = 443 if (scheme or "http") == "https" else 80
    if port != default:
        out["port_redirect"] = port
    return out


def _rewrite(spec: dict[str, Any], prefix: str | None, single_match: bool) -> dict[str, Any]:
    """URLRewrite as RouteAction fields (host and path rewrites)."""
    out: dict[str, Any] = {}
    hostname = spec.get("hostname")
    if hostname is not None:
        out["host_rewrite_literal"] = check_header_value(hostname)
    out.update(_path_modifier(as_dict(spec.get("path")), prefix, single_match, redirect=False))
    return out


def _path_modifier(
    spec: dict[str, Any], prefix: str | None, single_match: bool, *, redirect: bool
) -> dict[str, Any]:
    if not spec:
        return {}
    kind = spec.get("type")
    if kind == "ReplaceFullPath":
        value = check_path(as_str(spec.get("replaceFullPath")))
        if redirect:
            return {"path_redirect": value}
        return {"regex_rewrite": {"pattern": {"regex": "^.*$"}, "substitution": value}}
    if kind == "ReplacePrefixMatch":
        if prefix is None or not single_match:
            raise Invalid("ReplacePrefixMatch needs exactly one PathPrefix match")
        replacement = as_str(spec.get("replacePrefixMatch"))
        if replacement:
            check_path(replacement)
        return _replace_prefix(prefix, replacement)
    raise Invalid(f"unsupported path modifier {kind!r}")


def _replace_prefix(prefix: str, replacement: str) -> dict[str, Any]:
    """Swap the matched prefix element-wise (trailing slashes ignored on both sides):
    /foo/bar with /foo → /xyz gives /xyz/bar; with an empty replacement, /bar."""
    match = prefix.rstrip("/")
    target = replacement.rstrip("/")
    if match and target:
        return {"prefix_rewrite": target}
    escaped = re.escape(match)
    if not target:
        # /foo/bar → /bar, /foo and /foo/ → /
        return {"regex_rewrite": {"pattern": {"regex": f"^{escaped}/*"}, "substitution": "/"}}
    # Prefix "/" (everything): /bar → /xyz/bar.
    return {"regex_rewrite": {"pattern": {"regex": "^/"}, "substitution": f"{target}/"}}
