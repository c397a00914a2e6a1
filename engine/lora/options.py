"""vLLM's LoRA serving flags: ``--lora-modules`` in both its forms, and their checks."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the adapter name clients use, its directory, and the
    base model name ``/v1/models`` reports as its ``parent`` (default: the served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON ``{"name": …, "path": …, "base_model_name": …}``."""
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as error:
            raise ValueError(f"--lora-modules {value!r}: invalid JSON: {error}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"--lora-modules {value!r}: expected a JSON object")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {value!r}: unknown keys {sorted(unknown)}")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {value!r}: 'name' and 'path' must be strings")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {value!r}: 'base_model_name' must be a string")
        return LoRAModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
    return LoRAModule(name, path)


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    modules = [parse_lora_module(v) for v in values]
    names = [m.name for m in modules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"--lora-modules: duplicate adapter names {dupes}")
    return modules
