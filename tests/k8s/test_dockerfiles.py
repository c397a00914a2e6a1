"""Static checks of the Dockerfiles (no Docker engine here): what the chart and the
operator assume about the images holds — non-root, `infergate` entrypoint, the right
torch build per variant, and only the sources the build needs in the context."""

from __future__ import annotations

from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[2] / "docker"
IMAGES = ["operator", "epp", "engine", "engine-cuda"]


def final_stage(name: str) -> list[str]:
    lines = [ln.strip() for ln in (DOCKER / f"{name}.Dockerfile").read_text().splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
    assert len(starts) >= 2, "multi-stage: build tools stay out of the image"
    return lines[starts[-1] :]


@pytest.mark.parametrize("name", IMAGES)
def test_image_runs_infergate_as_non_root(name: str) -> None:
    stage = final_stage(name)
    users = [ln.split()[1] for ln in stage if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["infergate"]' in stage
    assert any("HOME=/tmp" in ln for ln in stage), "read-only root filesystem needs a writable HOME"


@pytest.mark.parametrize("name", IMAGES)
def test_build_context_is_limited(name: str) -> None:
    ignore = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[1:2] == ["*"] or "*" in ignore
    assert "!infergate/" in ignore and "!operator/" in ignore


def test_torch_builds_match_the_variant() -> None:
    operator = (DOCKER / "operator.Dockerfile").read_text()
    epp = (DOCKER / "epp.Dockerfile").read_text()
    cpu = (DOCKER / "engine.Dockerfile").read_text()
    cuda = (DOCKER / "engine-cuda.Dockerfile").read_text()
    # torch is filtered out of the operator's and the EPP's requirements (the same stage)
    for image in (operator, epp):
        assert 'engine_only = {"torch"' in image
    assert "download.pytorch.org/whl/cpu" in cpu
    # PyPI's torch is the CUDA build; the driver comes from the node's container toolkit
    assert "whl/cpu" not in cuda and "TORCH_INDEX_URL=https://pypi.org/simple" in cuda
    assert "NVIDIA_DRIVER_CAPABILITIES=compute" in cuda
    # no code uses FlashInfer: the image must not install or configure it
    assert "flashinfer" not in cuda.lower() and ".[gpu]" not in cuda
