"""An external Endpoint Picker (llm-d-router's or GIE's Go ``epp``) as a peer in the lab.

The lab runs the peer the way its own docs run it without Kubernetes: its
``file-discovery`` plugin reads the fleet from an endpoints file, it serves ext_proc to
the lab's Envoy, and Envoy dials its pick through GIE's reference ``ORIGINAL_DST``
cluster (``EnvoyConfig(upstream="original_dst")``) with request and response
bodies streamed FULL_DUPLEX, as that reference config does. The peer scrapes the
engines' vLLM metrics (``/metrics``) itself.

Nothing here builds or ships the peer: the user points ``--external-epp`` at a binary
built by hand (docs/routing-lab/peer/README.md). Without it the router is
skipped with a message that says how to build one.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

#: The plugin name the lab gives its file-discovery instance (replaces any discovery
#: section of a user's config: the lab owns the fleet).
DISCOVERY_PLUGIN = "infergate-lab-endpoints"

#: What ``--external-epp`` needs, said when it is missing.
BUILD_HINT = (
    "external-epp needs an Endpoint Picker binary: build llm-d-router's from a snapshot "
    "of the llm-d/llm-d-router repository with tools/peers/build_llmd_epp.sh SNAPSHOT "
    "~/.cache/infergate/peers/llm-d-epp and pass "
    "--external-epp ~/.cache/infergate/peers/llm-d-epp (docs/routing-lab/peer/README.md)"
)

#: llm-d-router's built-in default profile (what its EPP loads when given no config:
#: pkg/epp/config/loader/defaults.go): queue 2, KV-cache utilisation 2, approximate
#: prefix 3, max-score picker; the data layer's vLLM metrics source is added by the peer.
#: Written out because a config that names a discovery plugin must name its scorers too.
PEER_DEFAULT_CONFIG: dict[str, Any] = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"name": "queue-scorer", "type": "queue-scorer"},
        {"name": "kv-cache-utilization-scorer", "type": "kv-cache-utilization-scorer"},
        {"name": "prefix-cache-scorer", "type": "prefix-cache-scorer"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
            ],
        }
    ],
}


class ExternalEppError(ValueError):
    """The external EPP's config cannot be used; the message says why."""


def find_binary(path: Path | None) -> Path | None:
    """``path`` if it is an executable file, else None (the router is then skipped)."""
    if path is None:
        return None
    path = path.expanduser()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def load_config(path: Path | None) -> dict[str, Any]:
    """The user's EndpointPickerConfig (YAML), or the peer's default profile when None."""
    if path is None:
        return copy.deepcopy(PEER_DEFAULT_CONFIG)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ExternalEppError(f"--external-epp-config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ExternalEppError(f"--external-epp-config {path}: not YAML: {error}") from None
    if not isinstance(data, dict) or data.get("kind") != "EndpointPickerConfig":
        raise ExternalEppError(
            f"--external-epp-config {path}: not an EndpointPickerConfig (needs "
            "kind: EndpointPickerConfig)"
        )
    if not data.get("schedulingProfiles"):
        raise ExternalEppError(
            f"--external-epp-config {path}: no schedulingProfiles (with a discovery plugin "
            "the peer builds no default profile from its scorers)"
        )
    return data


def with_file_discovery(config: Mapping[str, Any], endpoints_file: Path) -> dict[str, Any]:
    """``config`` with the lab's file-discovery plugin as its only discovery source.

    A discovery section already there is replaced, and the plugin it named is dropped:
    the lab starts a fresh fleet per run and only its endpoints file knows it.
    """
    out = copy.deepcopy(dict(config))
    data_layer = dict(out.get("dataLayer") or {})
    previous = (data_layer.get("discovery") or {}).get("pluginRef")
    plugins = [p for p in out.get("plugins") or [] if p.get("name", p.get("type")) != previous]
    plugins.append(
        {
            "name": DISCOVERY_PLUGIN,
            "type": "file-discovery",
            "parameters": {"path": str(endpoints_file), "watchFile": False},
        }
    )
    out["plugins"] = plugins
    data_layer["discovery"] = {"pluginRef": DISCOVERY_PLUGIN}
    out["dataLayer"] = data_layer
    return out


def endpoints_document(addresses: Sequence[str]) -> dict[str, Any]:
    """The peer's endpoints file for ``host:port`` addresses (IPv4; port as a string)."""
    endpoints = []
    for index, address in enumerate(addresses):
        host, _, port = address.rpartition(":")
        endpoints.append({"name": f"engine-{index}", "address": host, "port": str(int(port))})
    return {"endpoints": endpoints}


def epp_argv(
    binary: Path, config_file: Path, *, grpc_port: int, health_port: int, metrics_port: int
) -> list[str]:
    """The peer's command line: plaintext ext_proc on the lab's free ports, no tracing
    (no collector to export to) and no pprof."""
    return [
        str(binary),
        "--config-file", str(config_file),
        "--pool-name", "infergate-lab",
        "--pool-namespace", "infergate-lab",
        "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health_port),
        "--metrics-port", str(metrics_port),
        "--secure-serving=false",
        "--tracing=false",
        "--enable-pprof=false",
    ]  # fmt: skip
