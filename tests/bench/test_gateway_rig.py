"""The overhead rig's direct twin is a config the real Envoy accepts, with no EPP in it."""

from __future__ import annotations

from pathlib import Path

import yaml

from infergate.bench.routing.routers import direct_twin
from infergate.envoy.bootstrap import FALLBACK_CLUSTER, EnvoyConfig, build_envoy_config
from infergate.envoy.process import validate_config


def test_direct_twin_drops_the_epp_and_is_valid(tmp_path: Path, envoy_binary: Path) -> None:
    config = direct_twin(
        build_envoy_config(
            EnvoyConfig(
                listen_port=8081,
                epp_address="127.0.0.1",
                epp_port=9002,
                fallback_endpoints=[("127.0.0.1", 8000)],
            )
        )
    )
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert clusters == {FALLBACK_CLUSTER}
    text = yaml.safe_dump(config)
    assert "ext_proc" not in text
    path = tmp_path / "direct.yaml"
    path.write_text(text)
    validate_config(path, envoy=envoy_binary)
