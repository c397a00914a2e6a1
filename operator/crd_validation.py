"""Validate objects against our CRDs the way the API server does, without a cluster.

The API server, for a custom resource: applies the schema's ``default`` values, rejects
fields the schema does not declare (kubectl's strict field validation), checks the
OpenAPI v3 schema, then evaluates the CEL ``x-kubernetes-validations`` rules. This
module does the same with ``jsonschema`` and ``cel-python`` so CI rejects a bad
object here exactly as a cluster would, and so the test API server (KMock) can too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

Json = Any


class ValidationFailed(ValueError):
    """An object broke its CRD's schema or CEL rules; ``errors`` lists each problem."""

    def __init__(self, kind: str, errors: list[str]) -> None:
        super().__init__(f"{kind} is invalid: " + "; ".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class CRDVersion:
    """One served version of one CRD: group, version, names and its schema."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    schema: dict[str, Any]
    subresources: frozenset[str] = field(default_factory=frozenset)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @cached_property
    def _json_schema(self) -> dict[str, Any]:
        return _strict(copy.deepcopy(self.schema))

    def default(self, obj: Json) -> Json:
        """A copy of ``obj`` with the schema's defaults filled in."""
        result = copy.deepcopy(obj)
        _apply_defaults(self.schema, result)
        return result

    def errors(self, obj: Json) -> list[str]:
        """Every schema and CEL violation of ``obj`` (already defaulted), as text."""
        import jsonschema

        validator = jsonschema.Draft202012Validator(self._json_schema)
        problems = [
            f"{_path(error.absolute_path)}: {error.message}"
            for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
        ]
        if not problems:  # CEL rules assume a schema-valid object, as in the API server
            problems.extend(_cel_errors(self.schema, obj, []))
        return problems

    def validate(self, obj: Json) -> Json:
        """Default, then validate; return the defaulted object or raise ValidationFailed."""
        defaulted = self.default(obj)
        problems = self.errors(defaulted)
        if problems:
            raise ValidationFailed(self.kind, problems)
        return defaulted


def load_crds(paths: Iterable[Path]) -> list[CRDVersion]:
    """Every served version of every CRD in the given files or folders (YAML)."""
    versions: list[CRDVersion] = []
    for path in _yaml_files(paths):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                versions.extend(crd_versions(doc))
    return versions


def crd_versions(crd: dict[str, Any]) -> list[CRDVersion]:
    spec = crd["spec"]
    return [
        CRDVersion(
            group=spec["group"],
            version=v["name"],
            kind=spec["names"]["kind"],
            plural=spec["names"]["plural"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            schema=v["schema"]["openAPIV3Schema"],
            subresources=frozenset((v.get("subresources") or {}).keys()),
        )
        for v in spec["versions"]
        if v.get("served", True)
    ]


class CRDRegistry:
    """CRD versions by apiVersion and kind, to validate any custom object."""

    def __init__(self, versions: Iterable[CRDVersion]) -> None:
        self.by_kind = {(v.api_version, v.kind): v for v in versions}

    @classmethod
    def from_paths(cls, *paths: Path) -> CRDRegistry:
        return cls(load_crds(paths))

    def find(self, api_version: str, kind: str) -> CRDVersion | None:
        return self.by_kind.get((api_version, kind))

    def validate(self, obj: Json) -> Json:
        crd = self.find(obj.get("apiVersion", ""), obj.get("kind", ""))
        if crd is None:
            raise KeyError(f"no CRD serves {obj.get('apiVersion')} {obj.get('kind')}")
        return crd.validate(obj)


def _yaml_files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.glob("*.yaml") if p.is_file())
        else:
            yield path


def _path(parts: Iterable[Any]) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
    return text.lstrip(".") or "<root>"


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Reject undeclared fields (strict field validation), except in ``metadata``."""
    if schema.get("type") == "object" and "properties" in schema:
        schema.setdefault("additionalProperties", False)
        for name, sub in schema["properties"].items():
            if name == "metadata" and sub.get("type") == "object" and "properties" not in sub:
                continue
            _strict(sub)
    if isinstance(schema.get("additionalProperties"), dict):
        _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        _strict(schema["items"])
    return schema


def _apply_defaults(schema: dict[str, Any], value: Json) -> None:
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                if name not in (schema.get("properties") or {}):
                    _apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _apply_defaults(schema["items"], item)


def _cel_errors(schema: dict[str, Any], value: Json, path: list[Any]) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations") or []:
        if not _cel_holds(rule["rule"], value):
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            yield f"{_path(path)}: {message}"
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from _cel_errors(sub, value[name], [*path, name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _cel_errors(schema["items"], item, [*path, index])


_PROGRAMS: dict[str, Any] = {}


def _cel_holds(rule: str, value: Json) -> bool:
    import celpy

    program = _PROGRAMS.get(rule)
    if program is None:
        env = celpy.Environment()
        program = _PROGRAMS[rule] = env.program(env.compile(rule))
    result = program.evaluate({"self": celpy.json_to_cel(value)})
    return bool(result) and not isinstance(result, Exception)
