"""One ZMQ SUB socket to one engine's PUB socket, read without blocking, redialled when dropped.

The completion feed (:mod:`infergate.epp.datalayer.completions`) reads this replica's
own records with one, by the event loop as messages arrive. (What is read only at a
decision, the load reports and the other replicas' admission records, comes over plain
TCP instead, :mod:`infergate.epp.datalayer.zmtp`: libzmq's I/O thread would receive it
as it arrives.) It needs care:

* Reading: a plain (not asyncio) socket, drained with ``NOBLOCK`` while ``EVENTS`` says
  something is queued. pyzmq's asyncio socket makes a future and a task step per
  message; the ZMQ descriptor is edge-triggered, so one wakeup covers all that is queued.
* Redialling: a frame over ``MAXMSGSIZE`` makes ZMQ drop the connection, and libzmq 4.3
  never dials that peer again (measured): one bad message would silence the engine for
  good. A monitor socket reports each disconnection, and :meth:`ZmqFeed.redial` dials
  again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

log = logging.getLogger("infergate.epp.datalayer.zmq_feed")


class ZmqFeed:
    """A SUB socket connected to ``url``, subscribed to ``topics``, with its monitor."""

    def __init__(self, context: Any, url: str, topics: Iterable[bytes], max_frame: int) -> None:
        import zmq

        self.url = url
        self.socket = zmq.Socket(context, zmq.SUB)
        for topic in topics:
            self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame)  # a peer sending more is cut off
        # A plain PAIR (get_monitor_socket would make an asyncio one on this context).
        watch = f"inproc://feed-monitor-{id(self.socket)}"
        self.socket.monitor(watch, zmq.EVENT_DISCONNECTED)
        self.monitor = zmq.Socket(context, zmq.PAIR)
        self.monitor.connect(watch)
        self.socket.connect(url)
        #: Messages read so far.
        self.read_count = 0

    def descriptors(self) -> tuple[int, int]:
        """The socket's and the monitor's descriptors, for an event loop's readers."""
        import zmq

        return int(self.socket.getsockopt(zmq.FD)), int(self.monitor.getsockopt(zmq.FD))

    def read(self) -> Iterator[list[bytes]]:
        """Every message queued now, without blocking."""
        import zmq

        socket = self.socket
        while int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.read_count += 1
            yield frames

    def redial(self) -> bool:
        """Dial again if the monitor saw the connection dropped; whether it did."""
        import zmq

        dropped = False
        while int(self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                self.monitor.recv_multipart(zmq.NOBLOCK)  # (event, value), endpoint
            except zmq.Again:
                break
            dropped = True
        if dropped:
            log.warning("engine feed dropped; redialling %s", self.url)
            with contextlib.suppress(zmq.ZMQError):  # not connected: connecting is enough
                self.socket.disconnect(self.url)
            self.socket.connect(self.url)
        return dropped

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
