"""The ``node`` tier: tests on a real node (kubelet, containerd, runc, CNI, kube-proxy).

Bringing the node up takes root and minutes (builds included, the first time), so these
tests run only when asked: ``sudo make test-node`` (which sets ``INFERGATE_NODE=1``). Without
it, or without root or Go, each skips and says why. One node serves the whole session.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.node import Node, NodeError, unavailable_reason


def _skip_reason() -> str | None:
    if os.environ.get("INFERGATE_NODE") != "1":
        return "node tests run only with INFERGATE_NODE=1 (`sudo make test-node`)"
    return unavailable_reason()


@pytest.fixture(scope="session")
def node() -> Iterator[Node]:
    """A node brought up once for the session and torn down after it."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    running = Node()
    try:
        running.start()
    except NodeError as error:
        pytest.fail(str(error))
    try:
        yield running
    finally:
        running.stop()
