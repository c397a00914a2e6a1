"""Compiled CPU kernels for the engine's decode step (see cpu_decode.py)."""
