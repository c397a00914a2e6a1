"""Small probes of a running stack: Prometheus scrapes and polling with a deadline.

Used by the end-to-end tests, which must see the same figures the EPP scores on
(parsed with prometheus_client's own parser, never by regex).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Prometheus text at ``url``: {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=timeout).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of every sample called ``name`` whose labels include ``labels``."""
    total = 0.0
    for (sample, sample_labels), value in scrape(url).items():
        if sample == name and all((k, v) in sample_labels for k, v in labels.items()):
            total += value
    return total


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition`` every 100 ms; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def engines_idle(engine_urls: list[str]) -> bool:
    """True when no engine has a request running or waiting."""
    for url in engine_urls:
        metrics = f"{url}/metrics"
        if metric_sum(metrics, "vllm:num_requests_running") or metric_sum(
            metrics, "vllm:num_requests_waiting"
        ):
            return False
    return True


def envoy_cluster_hosts(admin_url: str, cluster: str) -> dict[str, str]:
    """The hosts Envoy (admin at ``admin_url``) has in ``cluster``: {host:port: health flags}."""
    text = httpx.get(f"{admin_url}/clusters", timeout=5).text
    hosts: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith(f"{cluster}::") and "::health_flags::" in line:
            host, flags = line.split("::")[1], line.rsplit("::", 1)[1]
            hosts[host] = flags
    return hosts


def envoy_cluster_healthy(admin_url: str, cluster: str) -> bool:
    """Whether Envoy (admin at ``admin_url``) counts every host of ``cluster`` healthy."""
    flags = envoy_cluster_hosts(admin_url, cluster).values()
    return bool(flags) and all(flag == "healthy" for flag in flags)
