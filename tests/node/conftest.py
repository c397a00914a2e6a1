"""The ``node`` tier: tests on a real node (kubelet, containerd, runc, CNI, kube-proxy).

Bringing the node up takes root and minutes (builds included, the first time), so these
tests run only when asked: ``sudo make test-node`` (which sets ``INFERGATE_NODE=1``). Without
it, or without root or Go, each skips and says why. One node serves the whole session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.node import ROOT, Node, NodeError, unavailable_reason


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


IMAGES_DIR = Path(os.environ.get("INFERGATE_IMAGES_OUT", str(ROOT / "build" / "images")))
#: Where the chart looks for each image (values.yaml's repositories; tag = appVersion).
REPOSITORY = {name: f"ghcr.io/infergate/{name}" for name in ("operator", "epp", "engine")}
REPOSITORY["engine-cuda"] = "ghcr.io/infergate/engine"
TAG_SUFFIX = {"engine-cuda": "-cuda"}  # the chart's gpu.imageTagSuffix


@pytest.fixture(scope="session")
def node_image(node: Node) -> Callable[[str], str]:
    """``node_image("epp")``: ``make images``' layout imported into the node's containerd
    (once a session) under the chart's repository; returns the image reference. An image
    not built skips the test and says how to build it."""
    imported: dict[str, str] = {}

    def load(name: str) -> str:
        if name not in imported:
            layout = IMAGES_DIR / name
            if not (layout / "oci-layout").is_file():
                pytest.skip(f"image {name} not built: `sudo make images IMAGES={name}`")
            names = node.import_layout(layout, REPOSITORY[name], TAG_SUFFIX.get(name, ""))
            if not names:
                pytest.fail(f"containerd holds no {REPOSITORY[name]}:<tag> after the import")
            imported[name] = names[0]
        return imported[name]

    return load
