"""A/B benchmark runs: import infergate from another checkout of this repository.

With ``PYTHONPATH=benchmarks/ab_shim`` and ``IG_AB_ROOT=/path/to/worktree`` (a ``git
worktree add`` of an older commit, with the native ``.so`` files copied in), a process
of this ``.venv`` imports infergate from that worktree: the editable install's finder
maps each package to a folder of this checkout, and this rewrites the mapping's root.
``benchmarks/epp_overhead.py --variant "old:IG_AB_ROOT=/tmp/old PYTHONPATH=..."`` runs
the older EPP beside the current one in one run. Limit: a process started in this
checkout's root (``python -m`` puts the current directory first on ``sys.path``) still
takes the top-level ``infergate/`` folder (CLI, Envoy config, wire formats) from here;
``epp/`` and ``engine/``, which the finder maps, come from the worktree.
"""

import importlib
import os
from types import ModuleType

_ROOT = os.environ.get("IG_AB_ROOT")
if _ROOT:
    _finder: ModuleType | None
    try:
        _finder = importlib.import_module("__editable___infergate_0_1_0_finder")
    except ImportError:
        _finder = None
    if _finder is not None:
        _here = os.path.dirname(_finder.MAPPING["infergate"])  # this checkout's root
        for _key, _value in list(_finder.MAPPING.items()):
            _finder.MAPPING[_key] = _value.replace(_here, _ROOT, 1)
        for _key, _values in list(_finder.NAMESPACES.items()):
            _finder.NAMESPACES[_key] = [v.replace(_here, _ROOT, 1) for v in _values]
