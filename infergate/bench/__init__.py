"""Serving benchmark client whose metrics match ``vllm bench serve``."""
