"""Start the real Envoy binary on a generated config, and check a config with it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from infergate.envoy.binary import find_envoy
from infergate.procs import ManagedProcess, ProcessGroup, http_ready, tcp_ready


def envoy_argv(
    config_path: Path, *, envoy: Path | None = None, concurrency: int = 1, log_level: str = "warn"
) -> list[str]:
    """argv for one Envoy; hot restart is off so several Envoys can share a machine."""
    return [
        str(envoy or find_envoy()),
        "-c",
        str(config_path),
        "--log-level",
        log_level,
        "--concurrency",
        str(concurrency),
        "--disable-hot-restart",
    ]


def write_config(config: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def validate_config(config_path: Path, *, envoy: Path | None = None) -> None:
    """Run ``envoy --mode validate``; raise ValueError with Envoy's message when it rejects."""
    result = subprocess.run(
        [str(envoy or find_envoy()), "--mode", "validate", "-c", str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise ValueError(f"Envoy rejected {config_path}:\n{result.stdout}{result.stderr}")


def start_envoy(
    group: ProcessGroup,
    config: dict[str, Any],
    config_path: Path,
    *,
    name: str = "envoy",
    concurrency: int = 1,
    timeout: float = 60.0,
    log_path: Path | None = None,
) -> ManagedProcess:
    """Write ``config`` and start Envoy in ``group``; ready when admin says so (or the listener)."""
    write_config(config, config_path)
    admin = config.get("admin")
    if admin is not None:
        sock = admin["address"]["socket_address"]
        ready = http_ready(f"http://{sock['address']}:{sock['port_value']}/ready")
    else:
        listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
        host = "127.0.0.1" if listener["address"] in ("0.0.0.0", "::") else listener["address"]
        ready = tcp_ready(host, listener["port_value"])
    return group.start(
        name,
        envoy_argv(config_path, concurrency=concurrency),
        ready=ready,
        timeout=timeout,
        log_path=log_path,
    )
