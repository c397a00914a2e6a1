"""docs/local-stack.md's port table names every port flag of ``infergate up``, with its
default: a user who moves every listed port must not collide with a second stack."""

from __future__ import annotations

from pathlib import Path

from infergate.options import cli_fields
from infergate.stack.local import StackSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "local-stack.md"


def port_flags() -> dict[str, object]:
    """``up``'s port options (flag → default), read from their declarations."""
    return {
        spec.decls[0]: f.default
        for f, spec in cli_fields(StackSpec)
        if spec.decls[:1] and spec.decls[0].endswith("port")
    }


def table_rows() -> list[str]:
    """The rows of the table under the stack's diagram (the first table of the page)."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| component |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_port_table_names_every_port_flag_with_its_default() -> None:
    flags = port_flags()
    assert {"--port", "--admin-port", "--engine-port", "--completion-events-port"} <= set(flags)
    rows = table_rows()
    for flag, default in flags.items():
        row = next((r for r in rows if f"`{flag}`" in r), None)
        assert row is not None, f"{flag} is missing from docs/local-stack.md's port table"
        assert str(default) in row, f"{flag}'s row does not show its default {default}"
