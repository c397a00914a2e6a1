"""The OpenAI API through the real `openai` client and raw HTTP.

Behaviour that does not depend on the model runs on the simulated engine (deterministic
filler makes streamed and non-streamed outputs comparable); input validation and the
API key run against both the simulated and the real engine (``any_server``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .conftest import API_KEY, MODEL, Server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
TOO_LONG = "<longer than max_model_len>"

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_completion_and_its_stream_agree(sim_server: Server) -> None:
    client = sim_server.client()
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.text
    n_prompt = len(
        httpx.post(f"{sim_server.url}/tokenize", headers=AUTH, json={"prompt": PROMPT}).json()[
            "tokens"
        ]
    )
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (n_prompt, 12)
    assert done.usage.total_tokens == n_prompt + 12

    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # the simulator's filler is deterministic
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # The second identical prompt hit the prefix cache.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= 16


def test_default_max_tokens_is_16_for_completions(sim_server: Server) -> None:
    done = sim_server.client().completions.create(model=MODEL, prompt="Hello")
    assert done.usage is not None and done.usage.completion_tokens == 16


def test_chat_stream_and_not(sim_server: Server) -> None:
    client = sim_server.client()
    messages: Any = [{"role": "user", "content": "Tell me a story about a dragon."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    # Content parts are accepted too.
    parts: Any = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=2).choices


def test_simulated_chat_without_max_tokens_gets_the_sim_default(sim_server: Server) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    done = sim_server.client().chat.completions.create(model=MODEL, messages=messages)
    assert done.usage is not None and done.usage.completion_tokens == 256
    assert done.choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(sim_server: Server) -> None:
    client = sim_server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=30, stop=[stop], stream=True
            )
            got = "".join(c.choices[0].text for c in chunks)
        else:
            res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stop=stop)
            got = res.choices[0].text
            assert res.choices[0].finish_reason == "stop"
            assert (res.choices[0].model_extra or {})["stop_reason"] == stop
        assert got == cut


def test_stop_token_ids_and_token_ids_extension(sim_server: Server) -> None:
    http = sim_server.http()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "return_token_ids": True}
    first = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens = first["token_ids"]
    assert len(tokens) == 20
    stop_id = tokens[6]
    again = http.post("/v1/completions", json={**body, "stop_token_ids": [stop_id]}).json()
    choice = again["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == tokens[: tokens.index(stop_id) + 1]
    assert again["usage"]["completion_tokens"] == tokens.index(stop_id) + 1


def test_ignore_eos_and_sampling_fields_accepted(sim_server: Server) -> None:
    res = sim_server.client().completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0.7, top_p=0.9, seed=3,
        extra_body={"top_k": 5, "ignore_eos": True, "cache_salt": "tenant-a"},
    )  # fmt: skip
    assert res.usage is not None and res.usage.prompt_tokens == 4
    client = sim_server.client()
    for prompt in ([[5, 6, 7]], ["Hello"]):  # a batch of one is a single prompt
        one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert one.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "temperature": "hot"},
            400,
            "temperature",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 10**12},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": TOO_LONG,
            },
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            400,
            "tools",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "stop_token_ids": [-3]},
            400,
            "stop_token_ids",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "best_of": 3, "stream": True},
            400,
            "best_of",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "best_of": 2},
            400,
            "best_of",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "prompt_logprobs": 21},
            400,
            "prompt_logprobs",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 0, "stream": True},
            400,
            "max_tokens",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", []]}, 400, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": True,
                "top_logprobs": 21,
            },
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17},
            400,
            "n",
        ),
    ],
)
def test_bad_input_gets_openai_errors(
    any_server: Server, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, dict):  # sizes relative to this server's context length
        limit = any_server.max_model_len()
        if body.get("prompt") == TOO_LONG:
            body = {**body, "prompt": "word " * (limit + 8)}
        if body.get("max_completion_tokens") == TOO_LONG:
            body = {**body, "max_completion_tokens": limit + 1}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with any_server.http() as http:
        res = http.post(path, content=content, headers={"content-type": "application/json"})
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    assert error["param"] == param
    assert http_still_serves(any_server)


def http_still_serves(server: Server) -> bool:
    return httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_openai_client_raises_typed_errors(any_server: Server) -> None:
    client = any_server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=any_server.max_model_len())


def test_huge_body_is_rejected_cleanly(sim_server: Server) -> None:
    blob = b'{"model": "tiny", "prompt": "' + b"a" * (17 * 2**20) + b'"}'
    with sim_server.http() as http:
        res = http.post("/v1/completions", content=blob)
    assert res.status_code == 413 and res.json()["error"]["code"] == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap applies while reading
        yield blob[: 2**20]
        for i in range(2**20, len(blob), 2**20):
            yield blob[i : i + 2**20]

    with sim_server.http() as http:
        res = http.post("/v1/completions", content=chunks())
    assert res.status_code == 413 and res.json()["error"]["code"] == 413
    assert http_still_serves(sim_server)


def test_unknown_router_fields_are_ignored(sim_server: Server) -> None:
    extra = {"no_stop_trim": True, "skip_special_tokens": False, "return_hidden_states": False,
             "echo": False, "some_router_field": {"a": 1}}  # fmt: skip
    res = sim_server.client().completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, extra_body=extra
    )
    assert res.choices[0].finish_reason == "length"
    assert "ignoring unknown request fields" in sim_server.process.log_tail(100_000)


def test_api_key_guards_v1_and_tokenizer_routes(any_server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{any_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    res = httpx.post(f"{any_server.url}/v1/completions", json={"prompt": "x"})
    assert res.status_code == 401 and res.json()["error"]["code"] == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{any_server.url}{path}").status_code == 200
    for path, body in (
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
        ("/reset_prefix_cache", {}),
    ):
        res = httpx.post(f"{any_server.url}{path}", json=body)
        assert res.status_code == 401 and res.json()["error"]["code"] == 401


def test_reset_prefix_cache_only_in_dev_mode(real_server: Server) -> None:
    """The real server runs without --enable-dev-endpoints: the route does not exist."""
    with real_server.http() as http:
        res = http.post("/reset_prefix_cache")
    assert res.status_code == 404 and res.json()["error"]["code"] == 404


def test_models_version_tokenize_detokenize(sim_server: Server) -> None:
    models = sim_server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(f"{sim_server.url}/version").json()["version"]
    tok = httpx.post(
        f"{sim_server.url}/tokenize", headers=AUTH, json={"prompt": "Hello, world!"}
    ).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    text = httpx.post(
        f"{sim_server.url}/detokenize", headers=AUTH, json={"tokens": tok["tokens"]}
    ).json()
    assert text["prompt"].endswith("Hello, world!")
    chat = httpx.post(
        f"{sim_server.url}/tokenize",
        headers=AUTH,
        json={"messages": [{"role": "user", "content": "Hi"}]},
    ).json()
    assert chat["count"] > tok["count"] // 2
    res = httpx.post(f"{sim_server.url}/detokenize", headers=AUTH, json={"tokens": [10**9]})
    assert res.status_code == 400


def test_disconnect_mid_stream_aborts_and_frees_blocks(sim_server: Server) -> None:
    sim_server.wait_idle()
    before = sim_server.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "stream": True}
    with (
        httpx.Client(
            base_url=sim_server.url, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http,
        http.stream("POST", "/v1/completions", json=body) as res,
    ):
        assert res.status_code == 200
        lines = res.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert sim_server.gauge("vllm:num_requests_running") == 1
        assert sim_server.gauge("vllm:kv_cache_usage_perc") > 0
    # Leaving the block closed the connection mid-stream.
    sim_server.wait_idle(timeout=20)
    after = sim_server.metrics()
    key = f"vllm:request_success_total{{finished_reason=abort,model_name={MODEL}}}"
    assert after[key] == before[key] + 1


def test_disconnect_while_waiting_for_a_whole_answer_aborts(sim_server: Server) -> None:
    sim_server.wait_idle()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{sim_server.url}/v1/completions", json=body, timeout=1.0,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )  # fmt: skip
    sim_server.wait_idle(timeout=20)


def test_metrics_move_with_load(sim_server: Server) -> None:
    sim_server.wait_idle()
    before = sim_server.metrics()
    client = sim_server.client()
    seen: dict[str, float] = {"running": 0, "usage": 0}

    def watch() -> None:
        while not stop.is_set():
            seen["running"] = max(seen["running"], sim_server.gauge("vllm:num_requests_running"))
            seen["usage"] = max(seen["usage"], sim_server.gauge("vllm:kv_cache_usage_perc"))
            time.sleep(0.02)

    stop = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [
        threading.Thread(
            target=client.completions.create,
            kwargs={"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 60},
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    after = sim_server.metrics()
    m = f"{{model_name={MODEL}}}"
    assert seen["running"] >= 2 and 0 < seen["usage"] <= 1
    assert (
        after[f"vllm:generation_tokens_total{m}"] - before[f"vllm:generation_tokens_total{m}"]
        == 240
    )
    assert after[f"vllm:prompt_tokens_total{m}"] > before[f"vllm:prompt_tokens_total{m}"]
    assert (
        after[f"vllm:prefix_cache_queries_total{m}"] > before[f"vllm:prefix_cache_queries_total{m}"]
    )
    assert after[f"vllm:prefix_cache_hits_total{m}"] > before[f"vllm:prefix_cache_hits_total{m}"]
    key = f"vllm:request_success_total{{finished_reason=length,model_name={MODEL}}}"
    assert after[key] - before[key] == 4
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):  # fmt: skip
        count = f"vllm:{hist}_count{m}"
        assert after[count] > before[count]
    generated = f"vllm:request_generation_tokens_sum{m}"
    assert after[generated] - before[generated] == 240
    count = f"vllm:request_prompt_tokens_count{m}"
    assert after[count] - before[count] == 4
    assert after[f"vllm:num_preemptions_total{m}"] >= 0
    e = f"{{engine=0,model_name={MODEL}}}"
    for hist in ("request_time_per_output_token_seconds", "request_inference_time_seconds",
                 "request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens"):  # fmt: skip
        count = f"vllm:{hist}_count{e}"
        assert after[count] - before[count] == 4, hist
    assert (
        after[f"vllm:request_params_max_tokens_sum{e}"]
        - before[f"vllm:request_params_max_tokens_sum{e}"]
        == 240
    )
    assert after[f"vllm:request_params_n_sum{e}"] - before[f"vllm:request_params_n_sum{e}"] == 4
    generated = f"vllm:request_max_num_generation_tokens_sum{e}"
    assert after[generated] - before[generated] == 240
    iteration = f"vllm:iteration_tokens_total_sum{e}"
    assert after[iteration] - before[iteration] >= 240  # every decode token, plus prefill
    assert 'le="16384.0"' in httpx.get(f"{sim_server.url}/metrics").text
    assert after["vllm:cache_config_info{block_size=16,num_gpu_blocks=128}"] == 1
    steps = "infergate_sim_steps_total{}"
    assert after[steps] > before[steps]
    assert after["infergate_sim_modelled_seconds_total{}"] > 0
    lora = "vllm:lora_requests_info{max_lora=0,running_lora_adapters=,waiting_lora_adapters=}"
    assert after[lora] > 0
