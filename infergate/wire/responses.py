"""Response ids that name the engine holding a conversation, so any EPP can route to it.

The Responses API chains turns with ``previous_response_id``; the next turn is cheapest on
the engine that produced the previous one (its KV blocks are cached there, and its response
store holds the conversation). The EPP learns that engine from the id itself, with no
shared store, so the affinity survives EPP restarts and holds across EPP replicas:

* when the EPP routes a request to an endpoint it sets :data:`ROUTE_TAG_HEADER` to
  :func:`route_tag` of the endpoint's ``host:port``;
* the engine builds its response ids with :func:`make_response_id` from that tag, or from
  its own random tag when no EPP is in front of it;
* on the next turn the EPP reads the tag back with :func:`route_tag_of` and compares it with
  :func:`route_tag` of each endpoint it knows.

Format: ``resp_`` + 16 lowercase hex digits (the tag, xxh64 of the address) + 32 lowercase
hex digits (random). The whole id is 53 characters, as opaque to clients as OpenAI's.
"""

from __future__ import annotations

import re
import secrets

import xxhash

ROUTE_TAG_HEADER = "x-infergate-route-tag"
RESPONSE_ID_PREFIX = "resp_"
TAG_HEX = 16
_TAG = re.compile(r"[0-9a-f]{16}")
_ID = re.compile(r"resp_([0-9a-f]{16})[0-9a-f]{32}")


def route_tag(address: str) -> str:
    """The tag of an endpoint: xxh64 of its ``host:port``, 16 lowercase hex digits."""
    return xxhash.xxh64_hexdigest(address.encode())


def valid_tag(tag: str | None) -> bool:
    """True when ``tag`` has the tag's form (so a client cannot inject an arbitrary id)."""
    return tag is not None and _TAG.fullmatch(tag) is not None


def make_response_id(tag: str) -> str:
    """A fresh response id carrying ``tag``; ValueError if the tag is malformed."""
    if not valid_tag(tag):
        raise ValueError(f"route tag must be {TAG_HEX} lowercase hex digits, got {tag!r}")
    return f"{RESPONSE_ID_PREFIX}{tag}{secrets.token_hex(16)}"


def route_tag_of(response_id: str | None) -> str | None:
    """The tag inside a response id, or None when the id is not one of ours."""
    if not response_id:
        return None
    match = _ID.fullmatch(response_id)
    return match.group(1) if match else None
