"""infergate's KV transport over ZeroMQ: a ROUTER on the prefill engine, a DEALER per pull.

Wire format (multipart messages):

* pull request: ``[json {"op": "pull", "id": transfer_id}]``
* release request: ``[json {"op": "release", "id": transfer_id}]`` (no reply)
* pull reply: ``[json header, data]`` — the header is :meth:`KVPayload.header` plus
  ``"ok": true``, or ``{"ok": false, "error": "..."}`` with an empty data frame.

The producer frees the held blocks as soon as it has read them (the payload is a copy),
before sending. With ``link_bandwidth_gbps`` set, a pull lasts at least
``nbytes × 8 / (gbps × 10⁹)`` seconds — the modelled link (simulated mode).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import zmq
import zmq.asyncio
from infergate.engine.kv_transfer.config import KVTransferConfig
from infergate.engine.kv_transfer.connector import (
    KVConnector,
    KVPayload,
    ProducerHooks,
    RemoteParams,
    TransferError,
)

log = logging.getLogger(__name__)

POLL_MS = 200
EXPIRE_EVERY_S = 0.5


def transfer_seconds(nbytes: int, gbps: float) -> float:
    """Time ``nbytes`` take on a ``gbps`` link (0: not modelled)."""
    return nbytes * 8 / (gbps * 1e9) if gbps > 0 else 0.0


class ZmqConnector(KVConnector):
    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.extra = config.kv_connector_extra_config
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._actx: zmq.asyncio.Context | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.pulls_served = 0

    # -- producer ----------------------------------------------------------------------
    def start_producer(self, hooks: ProducerHooks) -> tuple[str, int]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        host = self.config.kv_ip
        bind_host = "*" if host in ("0.0.0.0", "::") else host
        try:
            if self.config.kv_port == 0:
                port = sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                sock.bind(f"tcp://{bind_host}:{self.config.kv_port}")
                port = self.config.kv_port
        except zmq.ZMQError:
            sock.close()
            raise
        self._thread = threading.Thread(
            target=self._serve, args=(sock, hooks), name="kv-transfer-producer", daemon=True
        )
        self._thread.start()
        return host, port

    def _serve(self, sock: zmq.Socket[bytes], hooks: ProducerHooks) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        last_expire = time.monotonic()
        try:
            while not self._stop.is_set():
                if dict(poller.poll(POLL_MS)).get(sock):
                    self._answer(sock, sock.recv_multipart(), hooks)
                if time.monotonic() - last_expire >= EXPIRE_EVERY_S:
                    last_expire = time.monotonic()
                    hooks.expire()
        except Exception:
            log.exception("KV transfer producer stopped")
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes], hooks: ProducerHooks) -> None:
        identity = frames[0]
        try:
            message = json.loads(frames[-1])
            op, tid = message["op"], str(message["id"])
        except (ValueError, KeyError, TypeError):
            log.warning("KV transfer: malformed request ignored")
            return
        if op == "release":
            hooks.release(tid)
            return
        if op != "pull":
            return
        try:
            payload = hooks.read(tid)
        except Exception as error:
            log.exception("KV transfer: reading %s failed", tid)
            payload = None
            reason = f"read failed: {error!r}"
        else:
            reason = "unknown or expired transfer id"
        if payload is None:
            header = json.dumps({"ok": False, "error": reason}).encode()
            sock.send_multipart([identity, header, b""])
            return
        # The payload is a copy: the blocks can go back to the pool before it is sent.
        hooks.release(tid)
        header = json.dumps({"ok": True, **payload.header()}).encode()
        sock.send_multipart([identity, header, payload.data], copy=False)
        self.pulls_served += 1

    # -- consumer ----------------------------------------------------------------------
    def _async_ctx(self) -> zmq.asyncio.Context:
        if self._actx is None:
            self._actx = zmq.asyncio.Context()
        return self._actx

    async def pull(self, remote: RemoteParams) -> KVPayload:
        started = time.monotonic()
        sock = self._async_ctx().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{_bracket(remote.host)}:{remote.port}")
            await sock.send_multipart(
                [json.dumps({"op": "pull", "id": remote.transfer_id}).encode()]
            )
            try:
                frames = await asyncio.wait_for(
                    sock.recv_multipart(), timeout=self.extra.pull_timeout_s
                )
            except TimeoutError:
                raise TransferError(
                    f"no answer from {remote.host}:{remote.port} in {self.extra.pull_timeout_s}s"
                ) from None
        finally:
            sock.close(linger=0)
        if len(frames) != 2:
            raise TransferError(f"malformed pull reply ({len(frames)} frames)")
        try:
            header = json.loads(frames[0])
        except ValueError:
            raise TransferError("malformed pull reply header") from None
        if not header.get("ok"):
            raise TransferError(str(header.get("error") or "the producer refused the pull"))
        payload = KVPayload(
            transfer_id=str(header["id"]),
            engine_id=str(header.get("engine_id") or ""),
            block_hashes=[int(h) for h in header["block_hashes"]],
            meta=dict(header.get("meta") or {}),
            data=bytes(frames[1]),
            nbytes=int(header.get("nbytes") or len(frames[1])),
        )
        wait = transfer_seconds(payload.nbytes, self.extra.link_bandwidth_gbps)
        wait -= time.monotonic() - started
        if wait > 0:
            await asyncio.sleep(wait)
        return payload

    async def release(self, remote: RemoteParams) -> None:
        sock = self._async_ctx().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        try:
            sock.connect(f"tcp://{_bracket(remote.host)}:{remote.port}")
            await sock.send_multipart(
                [json.dumps({"op": "release", "id": remote.transfer_id}).encode()]
            )
        finally:
            sock.close(linger=500)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        if self._actx is not None:
            self._actx.destroy(linger=0)
            self._actx = None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
