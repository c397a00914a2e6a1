"""Puts this folder's shared builders (gateway_objects.py) on the import path: the suite
runs with --import-mode=importlib, where test modules cannot import their siblings."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
