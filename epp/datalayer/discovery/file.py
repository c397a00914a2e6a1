"""``--endpoints FILE``: a YAML endpoints list, hot-reloaded.

```yaml
endpoints:
- {address: 10.0.0.7, port: 8000, labels: {inference.networking.k8s.io/engine-type: vllm}}
```

The watcher watches the file's directory, not the file, so editors and tools that write a
temporary file and rename it over the original (an atomic replace) are seen too, and so
is a mounted ConfigMap's update (kubelet swaps the ``..data`` symlink). A file
that fails to parse is logged and ignored: the previous endpoints stay.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import yaml
from infergate.epp.types import Endpoint
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("infergate.epp.datalayer.discovery")


class EndpointEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)
    labels: dict[str, str] = Field(default_factory=dict)


class EndpointsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    endpoints: list[EndpointEntry] = Field(default_factory=list)


class EndpointsFileError(ValueError):
    pass


def load_endpoints_file(path: Path) -> list[Endpoint]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise EndpointsFileError(f"{path}: {error}") from error
    try:
        parsed = EndpointsFile.model_validate(raw)
    except ValidationError as error:
        fields = "; ".join(
            ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors()
        )
        raise EndpointsFileError(f"{path}: {fields}") from error
    return [Endpoint(e.address, e.port, tuple(sorted(e.labels.items()))) for e in parsed.endpoints]


#: How often watchfiles' loop wakes (it takes the GIL each time to look at the stop
#: event): a change is seen within about this. At 20 ms the watch alone cost an idle EPP
#: ~2 ms of CPU a second, paid by every replica (docs/benchmarks/scale.md, "Replicas").
#: Only where inotify is missing (not Linux): see :func:`watch_file`.
WATCH_STEP_MS = 250

#: inotify(7): the file closed after a write, created, renamed in or out, removed.
IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x8, 0x40, 0x80
IN_CREATE, IN_DELETE = 0x100, 0x200
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
#: Not ``IN_MODIFY`` (every write): a file kept open beside the endpoints file (a log:
#: ``infergate up`` writes its processes' logs into the same directory) woke every
#: replica at each line it logged, 16 wakeups a replica in 15 s of the replicas
#: benchmark (docs/benchmarks/scale.md, "Replicas"). A file written in place is seen
#: when it is closed (``IN_CLOSE_WRITE``), which is also when it is whole.
WATCHED = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


async def watch_file(
    path: Path, on_change: Callable[[], None], stop: asyncio.Event, debounce_ms: int = 50
) -> None:
    """Call ``on_change`` whenever ``path`` is written, created, replaced or removed (once
    per burst of changes ``debounce_ms`` apart), until ``stop`` is set.

    On Linux an inotify descriptor on the event loop: no thread, and no wakeup until the
    directory changes. watchfiles' thread woke every :data:`WATCH_STEP_MS` to look at
    its stop event (~3 ms of CPU per 15 s idle, paid by every EPP replica); it is the
    fallback where inotify is missing.
    """
    target = path.absolute()

    def relevant(name: str) -> bool:
        # The file itself (in place, created, renamed over), or a kubelet ConfigMap
        # update, which swaps the ``..data`` symlink next to it.
        return name == target.name or name.startswith("..")

    def changed() -> None:
        try:
            on_change()
        except Exception:
            log.exception("reloading %s failed", path)

    descriptor = _inotify(target.parent)
    if descriptor is None:
        await _watch_polling(target, relevant, changed, stop, debounce_ms)
        return
    loop = asyncio.get_running_loop()
    pending: list[asyncio.TimerHandle] = []

    def readable() -> None:
        try:
            data = os.read(descriptor, 1 << 16)
        except BlockingIOError:
            return
        if any(relevant(name) for name in _event_names(data)) and not pending:
            pending.append(loop.call_later(debounce_ms / 1000, fire))

    def fire() -> None:
        pending.clear()
        changed()

    loop.add_reader(descriptor, readable)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(descriptor)
        os.close(descriptor)
        for timer in pending:
            timer.cancel()


def _inotify(directory: Path) -> int | None:
    """A non-blocking inotify descriptor watching ``directory`` (None: not available)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        descriptor = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if descriptor < 0:
        log.warning("inotify unavailable (%s): polling", os.strerror(ctypes.get_errno()))
        return None
    if libc.inotify_add_watch(descriptor, os.fsencode(directory), WATCHED) < 0:
        log.warning("cannot watch %s (%s): polling", directory, os.strerror(ctypes.get_errno()))
        os.close(descriptor)
        return None
    return descriptor


def _event_names(data: bytes) -> list[str]:
    """The file names in a read of inotify events."""
    names: list[str] = []
    offset = 0
    while offset + EVENT.size <= len(data):
        _wd, _mask, _cookie, size = EVENT.unpack_from(data, offset)
        start = offset + EVENT.size
        names.append(os.fsdecode(data[start : start + size].rstrip(b"\0")))
        offset = start + size
    return names


async def _watch_polling(
    target: Path,
    relevant: Callable[[str], bool],
    changed: Callable[[], None],
    stop: asyncio.Event,
    debounce_ms: int,
) -> None:
    """watchfiles, where inotify is missing."""
    from watchfiles import awatch

    async for _ in awatch(
        target.parent,
        watch_filter=lambda _change, name: relevant(Path(name).name),
        stop_event=stop,
        debounce=debounce_ms,
        step=WATCH_STEP_MS,
        recursive=False,
    ):
        changed()
