"""InferenceObjective (priority) and InferenceModelRewrite (model renames with weighted splits).

Both use GIE's ``inference.networking.x-k8s.io/v1alpha2`` shapes. In pool mode they come
from the cluster (filtered by ``spec.poolRef.name``); in standalone mode from the file
given by ``--objectives-file``: a multi-document YAML (or a ``kind: List`` with
``items``) of those same objects. A request names its objective with the header
``x-gateway-inference-objective``; an unknown or absent objective means priority 0.
The priority is the pool owner's: a client's own only counts where the EPP runs with
``--client-priority-max`` (:attr:`ObjectiveStore.client_priority_max`), and then clamped.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("infergate.epp.datalayer.objectives")

OBJECTIVE_HEADER = "x-gateway-inference-objective"


class _Meta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    namespace: str | None = None
    creationTimestamp: Any = None


class PoolRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = ""


class ObjectiveSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    priority: int | None = None
    poolRef: PoolRef | None = None


class InferenceObjective(BaseModel):
    model_config = ConfigDict(extra="allow")
    kind: str = "InferenceObjective"
    metadata: _Meta
    spec: ObjectiveSpec = Field(default_factory=ObjectiveSpec)


class ModelMatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = "Exact"
    value: str


class Match(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelMatch | None = None


class TargetModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    modelRewrite: str = Field(min_length=1)
    weight: int = Field(1, ge=0)


class RewriteRule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    matches: list[Match] = Field(default_factory=list)
    targets: list[TargetModel] = Field(default_factory=list)


class RewriteSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    poolRef: PoolRef | None = None
    rules: list[RewriteRule] = Field(default_factory=list)


class InferenceModelRewrite(BaseModel):
    model_config = ConfigDict(extra="allow")
    kind: str = "InferenceModelRewrite"
    metadata: _Meta
    spec: RewriteSpec = Field(default_factory=RewriteSpec)


class ObjectivesError(ValueError):
    pass


class ObjectiveStore:
    """Current objectives and rewrites; replaced wholesale or per object."""

    def __init__(
        self, pool_name: str | None = None, client_priority_max: int | None = None
    ) -> None:
        self.pool_name = pool_name
        #: The pool owner's opt-in (``--client-priority-max``): the highest priority a
        #: client may ask for itself; None: clients' own priority is ignored
        #: (epp/requestcontrol/priority.py).
        self.client_priority_max = client_priority_max
        self.objectives: dict[str, InferenceObjective] = {}
        self.rewrites: dict[str, InferenceModelRewrite] = {}

    def _for_pool(self, ref: PoolRef | None) -> bool:
        return self.pool_name is None or ref is None or not ref.name or ref.name == self.pool_name

    def replace(
        self, objectives: Iterable[InferenceObjective], rewrites: Iterable[InferenceModelRewrite]
    ) -> None:
        self.objectives = {o.metadata.name: o for o in objectives if self._for_pool(o.spec.poolRef)}
        self.rewrites = {r.metadata.name: r for r in rewrites if self._for_pool(r.spec.poolRef)}

    def upsert(self, obj: InferenceObjective | InferenceModelRewrite) -> None:
        if isinstance(obj, InferenceObjective):
            if self._for_pool(obj.spec.poolRef):
                self.objectives[obj.metadata.name] = obj
            else:
                self.objectives.pop(obj.metadata.name, None)
        elif self._for_pool(obj.spec.poolRef):
            self.rewrites[obj.metadata.name] = obj
        else:
            self.rewrites.pop(obj.metadata.name, None)

    def delete(self, kind: str, name: str) -> None:
        (self.objectives if kind == "InferenceObjective" else self.rewrites).pop(name, None)

    def priority(self, objective: str) -> int:
        found = self.objectives.get(objective) if objective else None
        if found is None or found.spec.priority is None:
            return 0
        return found.spec.priority

    def rewrite(self, model: str, rng: random.Random | None = None) -> str:
        """The target model for ``model``: the first matching rule (rewrites by name order,
        exact model matches before catch-all rules), target drawn by weight."""
        fallback: RewriteRule | None = None
        for name in sorted(self.rewrites):
            for rule in self.rewrites[name].spec.rules:
                if not rule.targets:
                    continue
                if not rule.matches:
                    fallback = fallback or rule
                    continue
                if any(m.model is not None and m.model.value == model for m in rule.matches):
                    return _draw(rule.targets, rng)
        return _draw(fallback.targets, rng) if fallback is not None else model


def _draw(targets: list[TargetModel], rng: random.Random | None) -> str:
    total = sum(t.weight for t in targets)
    if total <= 0:
        return targets[0].modelRewrite
    point = (rng or random).random() * total
    for target in targets:
        point -= target.weight
        if point < 0:
            return target.modelRewrite
    return targets[-1].modelRewrite


def parse_object(raw: dict[str, Any]) -> InferenceObjective | InferenceModelRewrite:
    kind = raw.get("kind")
    model: type[InferenceObjective] | type[InferenceModelRewrite]
    if kind == "InferenceObjective":
        model = InferenceObjective
    elif kind == "InferenceModelRewrite":
        model = InferenceModelRewrite
    else:
        raise ObjectivesError(f"kind {kind!r} is not InferenceObjective or InferenceModelRewrite")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        name = (raw.get("metadata") or {}).get("name", "?") if isinstance(raw, dict) else "?"
        fields = "; ".join(
            ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors()
        )
        raise ObjectivesError(f"{kind} {name}: {fields}") from error


def load_objectives_file(
    path: Path,
) -> tuple[list[InferenceObjective], list[InferenceModelRewrite]]:
    try:
        documents = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as error:
        raise ObjectivesError(f"{path}: {error}") from error
    raws: list[Any] = []
    for doc in documents:
        if doc is None:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("items"), list):
            raws.extend(doc["items"])
        else:
            raws.append(doc)
    objectives: list[InferenceObjective] = []
    rewrites: list[InferenceModelRewrite] = []
    for i, raw in enumerate(raws):
        if not isinstance(raw, dict):
            raise ObjectivesError(f"{path}: object {i} is not a mapping")
        try:
            obj = parse_object(raw)
        except ObjectivesError as error:
            raise ObjectivesError(f"{path}: object {i}: {error}") from error
        (objectives if isinstance(obj, InferenceObjective) else rewrites).append(obj)  # type: ignore[arg-type]
    return objectives, rewrites
