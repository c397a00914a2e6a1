"""A 15 MB prompt is refused from its length alone, and does not hold up other requests.

No timing is asserted (see benchmarks for numbers): the test checks the 400 names the
prompt, that a small request sent while the huge one is in flight is answered, and that
the server is still healthy afterwards — on the real tokenizer, for completions and chat.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .conftest import API_KEY, MODEL, Server

HUGE = "lorem ipsum dolor sit amet " * (15 * 2**20 // 27)  # ~15 MB


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip


def test_huge_prompt_gets_400_while_a_small_one_is_served(real_server: Server) -> None:
    small = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    huge_completion = {"model": MODEL, "prompt": HUGE, "max_tokens": 4}
    huge_chat = {"model": MODEL, "messages": [{"role": "user", "content": HUGE}]}
    with ThreadPoolExecutor(3) as pool:
        big = pool.submit(post, real_server, "/v1/completions", huge_completion)
        big_chat = pool.submit(post, real_server, "/v1/chat/completions", huge_chat)
        little = pool.submit(post, real_server, "/v1/completions", small)
        for res in (big.result(), big_chat.result()):
            assert res.status_code == 400, res.text[:500]
            error = res.json()["error"]
            assert error["param"] == "prompt" and "maximum context length" in error["message"]
        assert little.result().status_code == 200
    assert httpx.get(f"{real_server.url}/health", timeout=10).status_code == 200


def test_prompt_just_over_the_limit_is_still_exact(real_server: Server) -> None:
    """Below the cheap bound, the tokenized length decides (and names the prompt)."""
    limit = real_server.max_model_len()
    res = post(real_server, "/v1/completions",
               {"model": MODEL, "prompt": "word " * (limit + 8), "max_tokens": 1})  # fmt: skip
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "prompt"


def test_disconnect_mid_upload_is_one_log_line(sim_server: Server) -> None:
    """A client that sends half a body and hangs up: one INFO line, no traceback."""
    log_path = sim_server.process.log_path
    assert log_path is not None
    before = log_path.read_text(errors="replace")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", sim_server.port)) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "' + b"x" * 1000)
    deadline = time.monotonic() + 10
    new = ""
    while "disconnected during upload" not in new and time.monotonic() < deadline:
        time.sleep(0.05)
        new = log_path.read_text(errors="replace")[len(before) :]
    assert new.count("disconnected during upload") == 1, new
    assert "Traceback" not in new and "ERROR" not in new
    assert httpx.get(f"{sim_server.url}/health", timeout=10).status_code == 200
