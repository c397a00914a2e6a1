"""How the EPP process keeps its memory: malloc's thresholds and the garbage collector.

Both are about time, not size: each is a cost the request path paid per request (page
faults) or in pauses (full collections), measured in docs/benchmarks/epp-request-path.md
("Where the CPU goes").
"""

from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger("infergate.epp.heap")

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: Blocks under this come from the heap, not from a fresh ``mmap`` of their own; above a
#: request body's largest size (8 MiB) and its copies.
MMAP_THRESHOLD = 16 << 20
#: Free memory the heap keeps at its top instead of giving it back to the kernel.
TRIM_THRESHOLD = 32 << 20
#: What the heap grows by beyond each request for more.
TOP_PAD = 16 << 20


def keep_freed_memory() -> bool:
    """Have malloc reuse the memory of large buffers instead of returning it at once.

    Why: a 220 KB body passes through several buffers of its size (the socket read,
    the HTTP/2 message, the protobuf field, the parsed prompt). glibc's defaults give
    such blocks back to the kernel when freed, by ``munmap`` or by trimming the heap, so
    the next request touches fresh pages: measured 140 page faults per 220 KB request at
    100 req/s, 2 with these thresholds. The cost is memory held: at most
    ``TRIM_THRESHOLD`` + ``TOP_PAD`` (48 MiB) of freed heap stays mapped after a burst.
    False where the C library has no ``mallopt`` or refuses a parameter (not glibc):
    what it refused keeps its default.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD),
    )
    refused = [param for param, value in settings if mallopt(param, value) != 1]
    if refused:
        log.debug("mallopt refused parameters %s: malloc keeps its defaults there", refused)
    return not refused


def trim_heap() -> bool:
    """Give the kernel back the free memory of malloc's heaps (``malloc_trim(0)``).

    Why: a burst of large bodies leaves its freed buffers spread through the heap, and
    glibc returns only free memory at the heap's top, above ``TRIM_THRESHOLD``: measured
    534 MiB of RSS with 43 MiB in use after 100 bodies of 8 MiB (docs/benchmarks/resilience.md,
    "Memory under a flood"). ``malloc_trim`` also releases the free pages inside the heap.
    The native HTTP/2 module allocates through the same malloc (no allocator of its
    own). It holds the caller for tens of milliseconds when hundreds of MiB are free
    (measured 72 ms for 240 MiB), so the caller rate-limits it. False where
    the C library has no ``malloc_trim`` (not glibc).
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    malloc_trim(0)
    return True


def freeze_heap() -> None:
    """Move everything alive after start-up out of the garbage collector's reach.

    Why: a full collection traverses every tracked object, and start-up leaves ~70,000
    (modules, classes, protobuf descriptors, the config): measured 30-55 ms per full
    collection under load, a pause every request in flight waits out. Frozen objects are
    never traversed again (``gc.freeze``, as vLLM does after loading a model); they are
    still freed by reference counting. A request makes no cyclic garbage
    (``ExtProcCall.on_close``), so collections stay rare and cover what came later.
    """
    gc.collect()
    gc.freeze()
