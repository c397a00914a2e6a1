"""The EPP's malloc thresholds: buffers the size of a large request body are reused, not
handed back to the kernel and faulted in again on the next request."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource, sys
if sys.argv[1] == "tuned":
    from infergate.epp.heap import keep_freed_memory
    assert keep_freed_memory(), "mallopt refused"
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    held = [bytes(225280) for _ in range(3)]
    del held
before = faults()
for _ in range(200):  # three 220 KB bodies in flight, then done, 200 times
    held = [bytes(225280) for _ in range(3)]
    del held
print((faults() - before) / 200)
"""


def _faults_per_round(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return float(out.stdout.strip())


def test_large_buffers_are_reused_without_page_faults() -> None:
    # glibc's defaults fault the pages of each 220 KB buffer in again (the baseline shows
    # the probe measures something); with the EPP's thresholds they stay mapped.
    assert _faults_per_round("default") >= 10
    assert _faults_per_round("tuned") < 1
