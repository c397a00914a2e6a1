"""File discovery: hot reload on write, on atomic rename, and bad files keep the old set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from infergate.epp.datalayer.discovery.file import (
    EndpointsFileError,
    _event_names,
    _inotify,
    load_endpoints_file,
)
from infergate.epp.datalayer.discovery.static import parse_endpoint

from .conftest import eventually


def keys(epp) -> set[str]:
    return {s.key for s in epp.datastore.all()}


async def test_endpoints_file_hot_reload(epp_factory, tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints:\n- {address: 10.0.0.1, port: 8000}\n")
    epp = await epp_factory(endpoints_file=path)
    assert keys(epp) == {"10.0.0.1:8000"}

    path.write_text(
        "endpoints:\n- {address: 10.0.0.1, port: 8000}\n- {address: 10.0.0.2, port: 8000}\n"
    )
    await eventually(lambda: keys(epp) == {"10.0.0.1:8000", "10.0.0.2:8000"})

    # Atomic replace, as kubelet's ConfigMap updates and most editors do it.
    tmp = tmp_path / ".endpoints.yaml.tmp"
    tmp.write_text(
        "endpoints:\n- address: 10.0.0.3\n  port: 9000\n  labels: {inference.networking.k8s.io/engine-type: sglang}\n"
    )
    os.replace(tmp, path)
    await eventually(lambda: keys(epp) == {"10.0.0.3:9000"})
    state = epp.datastore.get("10.0.0.3:9000")
    assert (
        state is not None
        and state.endpoint.label("inference.networking.k8s.io/engine-type") == "sglang"
    )

    # A broken file is ignored; the previous endpoints stay.
    path.write_text("endpoints: [ {address: 10.0.0.4, port: not-a-port} ]\n")
    (tmp_path / "other.yaml").write_text("x: 1\n")  # unrelated files in the directory
    path.write_text("endpoints:\n- {address: 10.0.0.5, port: 8000}\n")
    await eventually(lambda: keys(epp) == {"10.0.0.5:8000"})
    path.write_text("endpoints: {{{\n")
    import asyncio

    await asyncio.sleep(0.5)
    assert keys(epp) == {"10.0.0.5:8000"}


def test_endpoints_file_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "e.yaml"
    path.write_text("endpoints:\n- {address: 10.0.0.1, port: 70000}\n")
    with pytest.raises(EndpointsFileError, match=r"endpoints\.0\.port"):
        load_endpoints_file(path)
    with pytest.raises(EndpointsFileError):
        load_endpoints_file(tmp_path / "missing.yaml")


def test_static_endpoint_parsing() -> None:
    assert parse_endpoint("127.0.0.1:8000").key == "127.0.0.1:8000"
    assert parse_endpoint("[fd00::7]:8000").key == "[fd00::7]:8000"
    for bad in ("nohost", "1.2.3.4:", "1.2.3.4:99999", ":80"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


async def test_configmap_style_symlink_swap_reloads(epp_factory, tmp_path: Path) -> None:
    """kubelet mounts ConfigMap keys as FILE -> ..data/FILE and updates by swapping ..data."""
    first = tmp_path / "..2026_11_22_a"
    first.mkdir()
    (first / "endpoints.yaml").write_text("endpoints:\n- {address: 10.0.1.1, port: 8000}\n")
    (tmp_path / "..data").symlink_to(first.name)
    path = tmp_path / "endpoints.yaml"
    path.symlink_to("..data/endpoints.yaml")
    epp = await epp_factory(endpoints_file=path)
    assert keys(epp) == {"10.0.1.1:8000"}

    second = tmp_path / "..2026_11_22_b"
    second.mkdir()
    (second / "endpoints.yaml").write_text("endpoints:\n- {address: 10.0.1.2, port: 8000}\n")
    (tmp_path / "..data_tmp").symlink_to(second.name)
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    await eventually(lambda: keys(epp) == {"10.0.1.2:8000"})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_a_log_written_beside_the_file_wakes_no_watcher(tmp_path: Path) -> None:
    """``infergate up`` writes its logs into the endpoints file's directory: appending to
    them (a file kept open) must not wake the EPP, while writing the endpoints file in
    place still does, once it is closed."""
    (tmp_path / "engine-0.log").touch()  # the log exists before the EPP starts
    descriptor = _inotify(tmp_path)
    assert descriptor is not None
    try:
        with open(tmp_path / "engine-0.log", "a") as log:
            for line in range(5):
                log.write(f"line {line}\n")
                log.flush()
            with pytest.raises(BlockingIOError):  # nothing queued: the loop is not woken
                os.read(descriptor, 1 << 16)
            (tmp_path / "endpoints.yaml").write_text("endpoints: []\n")
            assert "endpoints.yaml" in _event_names(os.read(descriptor, 1 << 16))
    finally:
        os.close(descriptor)
