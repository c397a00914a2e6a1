"""How the translator renders Envoy config: :class:`TranslateOptions`.

Kept apart from :mod:`infergate.gateway.translate` so every translator module can read
the options without importing the entry point.
"""

from __future__ import annotations

from dataclasses import dataclass

EPP_HEALTH_CHECKS = ("tcp", "grpc", "none")
POOL_WITHOUT_EPP = ("balance", "reject")


@dataclass(frozen=True)
class TranslateOptions:
    """Knobs of the generated config; the defaults suit any conforming EPP.

    * ``epp_tls``: speak TLS to EPPs (without verifying their certificate, as GIE's
      gateways do). True by default because GIE's reference EPP serves TLS by default
      (``--secure-serving``) and the infergate operator runs its EPPs with
      ``--secure-serving`` too (infergate's own ``epp`` command defaults to plaintext:
      set False for such EPPs). An EPP Service port whose ``appProtocol`` is
      ``kubernetes.io/h2c`` (HTTP/2 over cleartext) is always reached in plaintext.
    * ``epp_health_check``: how Envoy health-checks EPP pods on their ext-proc port.
      ``tcp`` (default) works for any EPP; ``grpc`` asks gRPC health service
      ``epp_health_service`` on the ext-proc port (infergate's EPP serves it there,
      GIE's serves health on another port); ``none`` disables it. A health-checked EPP
      lets FailOpen apply before the request body starts streaming.
    * ``response_bodies``: stream response bodies to the EPP (FULL_DUPLEX_STREAMED, GIE's
      protocol). False sends it the response headers only (for EPPs that learn usage
      elsewhere, e.g. infergate engines' completion records).
    * ``pool_without_epp``: an InferencePool with no ``endpointPickerRef`` (optional since
      GIE v1.5) is either balanced least-request over its endpoints (``balance``, pool
      Accepted) or refused (``reject``: Accepted False, EndpointPickerRefMissing, 500).
    * ``now``: the time written to conditions that change status (RFC 3339; None: now).
    * ``gateway_api_bundle_version``: the ``gateway.networking.k8s.io/bundle-version`` of
      the installed Gateway API CRDs, when the caller knows it: GatewayClasses then carry
      ``SupportedVersion`` (True for v1.x).
    """

    epp_tls: bool = True
    epp_health_check: str = "tcp"
    epp_health_service: str = "liveness"
    epp_health_check_interval_s: float = 1.0
    response_bodies: bool = True
    pool_without_epp: str = "balance"
    fallback_retries: int = 3
    route_timeout_s: float = 300.0
    message_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    stream_idle_timeout_s: float = 300.0
    max_requests: int = 40000
    listen_address: str = "0.0.0.0"
    access_log: bool = False
    now: str | None = None
    gateway_api_bundle_version: str | None = None

    def __post_init__(self) -> None:
        if self.epp_health_check not in EPP_HEALTH_CHECKS:
            raise ValueError(f"epp_health_check must be one of {EPP_HEALTH_CHECKS}")
        if self.pool_without_epp not in POOL_WITHOUT_EPP:
            raise ValueError(f"pool_without_epp must be one of {POOL_WITHOUT_EPP}")
        if self.route_timeout_s <= 0 or self.epp_health_check_interval_s <= 0:
            raise ValueError("timeouts and intervals must be > 0")
        if self.fallback_retries < 0:
            raise ValueError("fallback_retries must be >= 0")
