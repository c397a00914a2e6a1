"""Streamed completions at a steady rate, each on its own connection, until told to stop.

Run as a script inside the node's network namespace (ClusterIPs route only there; see
:meth:`tests.support.node.Node.popen`), standard library only::

    python stream_load.py URL RATE MAX_TOKENS [LONG_EVERY LONG_MAX_TOKENS]

It starts RATE requests a second (every LONG_EVERY-th one asks for LONG_MAX_TOKENS
tokens instead) until a line arrives on stdin (or stdin closes), waits for every request
it started, and prints one JSON object: how many ended which way. ``complete``: status 200
and the stream ended with ``data: [DONE]`` and the last chunk; ``cut``: 200 but the stream
ended early; a status code; or ``connect:<error>`` / ``io:<error>``. A request started is
counted once, so the counts add up to the number started (``started``).

A new connection per request (``Connection: close``), as a client behind a Service often
has: each lands on whichever proxy pod kube-proxy's rules pick at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections import Counter
from urllib.parse import urlsplit

#: A stream's longest time; it is far beyond the rollouts' drain.
READ_TIMEOUT_S = 300.0


def _request(url: str, max_tokens: int) -> bytes:
    parts = urlsplit(url)
    body = json.dumps(
        {"model": "tiny", "prompt": "Stream through a rollout", "max_tokens": max_tokens,
         "stream": True, "ignore_eos": True}
    ).encode()  # fmt: skip
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _one(host: str, port: int, request: bytes) -> str:
    """One streamed completion; how it ended (the module docstring's outcomes)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
    except (OSError, TimeoutError) as error:
        return f"connect:{type(error).__name__}"
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), READ_TIMEOUT_S)
    except (OSError, TimeoutError) as error:
        return f"io:{type(error).__name__}"
    finally:
        writer.close()
    status = data.split(b"\r\n", 1)[0].split(b" ")
    code = status[1].decode() if len(status) > 1 else "no-status"
    if code != "200":
        return code
    ended = b"data: [DONE]" in data and data.endswith(b"0\r\n\r\n")
    return "complete" if ended else "cut"


async def _run(url: str, rate: float, tokens: int, long_every: int, long_tokens: int) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    short, long = _request(url, tokens), _request(url, long_tokens)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # stdin's first line (or its end) stops the load: a thread, so no pipe is attached to
    # the loop.
    threading.Thread(
        target=lambda: (sys.stdin.readline(), loop.call_soon_threadsafe(stop.set)), daemon=True
    ).start()
    tasks: list[asyncio.Task[str]] = []
    start = loop.time()
    while not stop.is_set():
        n = len(tasks)
        request = long if long_every and n % long_every == long_every - 1 else short
        tasks.append(asyncio.create_task(_one(host, port, request)))
        delay = start + (n + 1) / rate - loop.time()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
    outcomes = Counter(await asyncio.gather(*tasks))
    print(json.dumps({"started": len(tasks), "outcomes": dict(outcomes)}), flush=True)


def main(argv: list[str]) -> None:
    if len(argv) not in (3, 5):
        sys.exit("usage: stream_load.py URL RATE MAX_TOKENS [LONG_EVERY LONG_MAX_TOKENS]")
    url, rate, tokens = argv[0], float(argv[1]), int(argv[2])
    long_every, long_tokens = (int(argv[3]), int(argv[4])) if len(argv) == 5 else (0, tokens)
    asyncio.run(_run(url, rate, tokens, long_every, long_tokens))


if __name__ == "__main__":
    main(sys.argv[1:])
