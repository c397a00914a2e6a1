"""Operator-wide settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default) or default


@dataclass(frozen=True)
class OperatorSettings:
    """What every EPP the operator deploys gets unless a pool annotation says otherwise."""

    epp_image: str = "ghcr.io/infergate/epp:latest"
    envoy_image: str = "docker.io/envoyproxy/envoy:v1.33-latest"
    image_pull_policy: str = "IfNotPresent"
    epp_replicas: int = 1
    epp_cpu_request: str = "250m"
    epp_memory_request: str = "256Mi"
    epp_memory_limit: str = "1Gi"
    envoy_cpu_request: str = "100m"
    envoy_memory_request: str = "128Mi"
    envoy_memory_limit: str = "512Mi"
    epp_log_level: str = "info"
    #: Seconds between full resyncs of each pool (status follows pods even without events).
    resync_seconds: float = 30.0
    extra_epp_args: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls) -> OperatorSettings:
        base = cls()
        return cls(
            epp_image=_env("INFERGATE_EPP_IMAGE", base.epp_image),
            envoy_image=_env("INFERGATE_ENVOY_IMAGE", base.envoy_image),
            image_pull_policy=_env("INFERGATE_IMAGE_PULL_POLICY", base.image_pull_policy),
            epp_replicas=int(_env("INFERGATE_EPP_REPLICAS", str(base.epp_replicas))),
            epp_cpu_request=_env("INFERGATE_EPP_CPU_REQUEST", base.epp_cpu_request),
            epp_memory_request=_env("INFERGATE_EPP_MEMORY_REQUEST", base.epp_memory_request),
            epp_memory_limit=_env("INFERGATE_EPP_MEMORY_LIMIT", base.epp_memory_limit),
            resync_seconds=float(_env("INFERGATE_RESYNC_SECONDS", str(base.resync_seconds))),
            extra_epp_args=tuple(os.environ.get("INFERGATE_EPP_EXTRA_ARGS", "").split()),
        )
