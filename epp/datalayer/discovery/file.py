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
import logging
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
WATCH_STEP_MS = 250


async def watch_file(
    path: Path, on_change: Callable[[], None], stop: asyncio.Event, debounce_ms: int = 50
) -> None:
    """Call ``on_change`` whenever ``path`` is written, created, replaced or removed."""
    from watchfiles import awatch

    target = path.absolute()
    directory = target.parent

    def relevant(_change: object, changed: str) -> bool:
        changed_path = Path(changed)
        # The file itself (in place, created, renamed over), or a kubelet ConfigMap
        # update, which swaps the ``..data`` symlink next to it.
        return changed_path == target or changed_path.name.startswith("..")

    async for _ in awatch(
        directory,
        watch_filter=relevant,
        stop_event=stop,
        debounce=debounce_ms,
        step=WATCH_STEP_MS,
        recursive=False,
    ):
        try:
            on_change()
        except Exception:
            log.exception("reloading %s failed", path)
