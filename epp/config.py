"""The EndpointPickerConfig (GIE's YAML shape), validated at start-up.

```yaml
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer        # registered type name
  name: prefix                     # optional; defaults to the type
  parameters: {blockSizeTokens: 16}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix
    weight: 3
saturationDetector: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}
flowControl: {maxRequestsPerEndpoint: 4, defaultRequestTTL: 20s}   # optional; off if absent
```

Errors name the offending field (``plugins[1].parameters.blockSize: ...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from infergate.epp.flowcontrol.config import FlowControlConfig
from infergate.epp.flowcontrol.saturation import SaturationConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot run; the message names the field."""


class PluginSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = Field(min_length=1)
    name: str | None = None
    parameters: dict[str, Any] | None = None


class ProfilePluginRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pluginRef: str = Field(min_length=1)
    weight: float | None = Field(None, ge=0)


class SchedulingProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    plugins: list[ProfilePluginRef] = Field(default_factory=list)


class EndpointPickerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    apiVersion: str = "inference.networking.x-k8s.io/v1alpha1"
    kind: str = "EndpointPickerConfig"
    plugins: list[PluginSpec] = Field(default_factory=list)
    schedulingProfiles: list[SchedulingProfile] = Field(default_factory=list)
    saturationDetector: SaturationConfig = Field(
        default_factory=lambda: SaturationConfig.model_validate({})
    )
    # Sections GIE defines that this EPP accepts but does not act on.
    featureGates: Any = None
    data: Any = None
    parser: Any = None
    #: Off when absent (or ``enabled: false``); see infergate.epp.flowcontrol.config.
    flowControl: FlowControlConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> EndpointPickerConfig:
        if self.kind != "EndpointPickerConfig":
            raise ValueError(f"kind must be EndpointPickerConfig, not {self.kind!r}")
        names: set[str] = set()
        for spec in self.plugins:
            name = spec.name or spec.type
            if name in names:
                raise ValueError(f"plugin name {name!r} is defined twice")
            names.add(name)
        seen_profiles: set[str] = set()
        for i, profile in enumerate(self.schedulingProfiles):
            if profile.name in seen_profiles:
                raise ValueError(f"schedulingProfiles[{i}].name {profile.name!r} is repeated")
            seen_profiles.add(profile.name)
            for j, ref in enumerate(profile.plugins):
                if ref.pluginRef not in names:
                    raise ValueError(
                        f"schedulingProfiles[{i}].plugins[{j}].pluginRef: no plugin named "
                        f"{ref.pluginRef!r} (defined: {', '.join(sorted(names)) or 'none'})"
                    )
        return self


#: GIE's default profile as llm-d-router's EPP runs it (its built-in default plugins): queue
#: 2, KV-cache utilisation 2, approximate prefix 3, with the peer's prefix blocks of 64
#: tokens (4 bytes each) matched up to 2,048 blocks. No filter: the peer's saturation
#: detector only gates admission of sheddable requests, as infergate's admission does.
#: (docs/routing-lab/peer/README.md lists how the two were compared.)
GIE_DEFAULT_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  parameters: {blockSizeTokens: 64, maxPrefixBlocksToMatch: 2048}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""

#: infergate's default, chosen on the routing lab's workload matrix and its trace family
#: (docs/benchmarks/routing.md, ``infergate bench routing --matrix standard`` and
#: ``--matrix trace``): the predicted-latency scorer decides (the calibrated prefix index
#: feeds it: it runs for its prepare/pre-request/response hooks without a weight of its
#: own); LoRA affinity counts only for requests to adapters on engines that report adapter
#: slots. No request-count bound (``bounded-load-filter``): on traces whose prompts differ
#: 100x it removed the engines with the most requests in flight (short prompts, decoding),
#: often while their prefill queues were shorter than those of engines it kept; the
#: scorer's burst accounting keeps a burst from piling onto one engine. Response affinity
#: runs first: a Responses turn that names ``previous_response_id`` goes to the engine
#: holding it (another engine's store cannot answer it), whatever its load. The picker
#: names up to 4 endpoints, best first: the rest are the gateway's fallbacks when the best
#: one refuses the connection (an engine killed since its last scrape). On pools of more
#: than 64 endpoints the candidate-sampling filter keeps the prefix and adapter holders
#: plus 32 random others (power of d choices), so a decision's cost does not grow with the
#: pool; smaller pools are kept whole.
DEFAULT_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: response-affinity-filter
- type: candidate-sampling-filter
- type: prefix-cache-scorer
  parameters: {maxPrefixBlocksToMatch: 16384}
- type: predicted-latency-scorer
- type: lora-affinity-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 4}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: response-affinity-filter
  - pluginRef: candidate-sampling-filter
  - pluginRef: predicted-latency-scorer
    weight: 1
  - pluginRef: lora-affinity-scorer
    weight: 2
  - pluginRef: max-score-picker
"""

#: GIE's default profile with the precise (KV-event driven) prefix scorer in place of the
#: approximate one: llm-d's "precise prefix-cache aware" routing.
GIE_PRECISE_PREFIX_CONFIG_YAML = GIE_DEFAULT_CONFIG_YAML.replace(
    "- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 64, maxPrefixBlocksToMatch: 2048}\n",
    "- type: precise-prefix-cache-scorer\n",
).replace("pluginRef: prefix-cache-scorer", "pluginRef: precise-prefix-cache-scorer")

#: infergate's default profile with flow control on (docs/epp.md, "Flow control"): requests
#: wait in the EPP by priority band and tenant while each endpoint has 4 EPP-routed
#: requests unfinished or the whole pool is saturated; 20 s in the queue answers 429.
FLOW_CONTROL_CONFIG_YAML = (
    DEFAULT_CONFIG_YAML
    + """\
flowControl:
  maxRequests: 10000
  maxBytes: 1073741824
  defaultRequestTTL: 20s
  maxRequestsPerEndpoint: 4
  useSaturationDetector: true
  fairnessPolicy: round-robin
"""
)

#: infergate's default with the engines' KV events as well (``infergate up
#: --precise-prefix``): the precise index gives exact token counts and confirmed blocks,
#: the calibrated approximate index covers the window before an event arrives; the
#: predicted-latency scorer takes the larger cached estimate.
PRECISE_PREFIX_CONFIG_YAML = DEFAULT_CONFIG_YAML.replace(
    "- type: predicted-latency-scorer\n",
    "- type: precise-prefix-cache-scorer\n  parameters: {maxPrefixBlocksToMatch: 8192}\n"
    "- type: predicted-latency-scorer\n",
)

#: Prefill/decode disaggregation (docs/epp.md, "Prefill/decode disaggregation"): the
#: decode profile picks among ``decode``/``both`` engines with GIE's default scorers; when
#: more than 256 prompt tokens are not cached on that pick, the prefill profile picks a
#: ``prefill`` engine, named to the decode engine in ``x-prefiller-host-port``.
PD_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: pd-profile-handler
  parameters: {threshold: 256, prefillProfile: prefill, decodeProfile: decode}
- type: decode-filter
- type: prefill-filter
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""


def pd_config(threshold: int = 256) -> str:
    """``builtin:pd`` with another threshold (uncached prompt tokens above which a request
    is disaggregated); used by ``infergate up --roles`` and by the operator."""
    if threshold < 0:
        raise ConfigError(f"the P/D threshold must be >= 0, not {threshold}")
    return PD_CONFIG_YAML.replace("threshold: 256,", f"threshold: {int(threshold)},")


#: Configs available by name: ``--config-file builtin:NAME``.
BUILTIN_CONFIGS = {
    "infergate-default": DEFAULT_CONFIG_YAML,
    "gie-default": GIE_DEFAULT_CONFIG_YAML,
    "precise-prefix": PRECISE_PREFIX_CONFIG_YAML,
    "flow-control": FLOW_CONTROL_CONFIG_YAML,
    "gie-precise-prefix": GIE_PRECISE_PREFIX_CONFIG_YAML,
    # The default has LoRA affinity now; the name stays for configs that use it.
    "lora": DEFAULT_CONFIG_YAML,
    "pd": PD_CONFIG_YAML,
}
BUILTIN_PREFIX = "builtin:"


def _format(error: ValidationError, prefix: str = "") -> str:
    lines = []
    for item in error.errors():
        path = prefix
        for part in item["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        lines.append(f"{path or '(top level)'}: {item['msg']}")
    return "; ".join(lines)


def parse_config(text: str, source: str = "config") -> EndpointPickerConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from error
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return EndpointPickerConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(f"{source}: {_format(error)}") from error


def load_config(path: Path | str | None) -> EndpointPickerConfig:
    """The config at ``path``, a built-in one (``builtin:NAME``), or infergate's default."""
    if path is None:
        return parse_config(DEFAULT_CONFIG_YAML, "built-in default config")
    if str(path).startswith(BUILTIN_PREFIX):
        name = str(path)[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_CONFIGS:
            raise ConfigError(
                f"{path}: no built-in config {name!r} (built in: {', '.join(BUILTIN_CONFIGS)})"
            )
        return parse_config(BUILTIN_CONFIGS[name], str(path))
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error}") from error
    return parse_config(text, str(path))


def validate_parameters(
    config: EndpointPickerConfig, registry: dict[str, Any]
) -> list[tuple[PluginSpec, BaseModel]]:
    """Check every plugin's type and parameters; returns the parsed parameters in order."""
    parsed: list[tuple[PluginSpec, BaseModel]] = []
    for i, spec in enumerate(config.plugins):
        cls = registry.get(spec.type)
        if cls is None:
            raise ConfigError(
                f"plugins[{i}].type: unknown plugin type {spec.type!r} "
                f"(known: {', '.join(sorted(registry))})"
            )
        try:
            params = cls.Params.model_validate(spec.parameters or {})
        except ValidationError as error:
            raise ConfigError(_format(error, f"plugins[{i}].parameters")) from error
        parsed.append((spec, params))
    return parsed
