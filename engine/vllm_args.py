"""``vllm serve``'s command line, as GIE's and llm-d's manifests write it, for ``engine serve``.

vLLM parses its flags with argparse, so manifests rely on things click (typer) does not
do: a unique prefix of a long option names it (``--max-num-seq``), and the model may be
given as ``--model``. A few flags also have no meaning here and are accepted so a manifest
runs unchanged. This module rewrites such an argument list into the one ``engine serve``
declares; the option names come from the command itself, so nothing is declared twice.
Several values after one flag (``--served-model-name a b``, ``--lora-modules x=/x
y=/y``) the command parses itself (:class:`infergate.options.SeveralValues`), so they work
from any caller, not only through this rewrite.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Flags that change nothing here, with why (each is logged once when given): flag →
#: (takes a value, reason).
NO_OPS: dict[str, tuple[bool, str]] = {
    "--enforce-eager": (False, "there are no CUDA graphs to disable"),
    "--compilation-config": (True, "nothing is compiled (torch eager)"),
    "--enable-chunked-prefill": (False, "prefill is always chunked"),
    "--disable-uvicorn-access-log": (False, "the access log is always off"),
}
#: vLLM's names for flags ``engine serve`` calls otherwise.
RENAMED = {"--uvicorn-log-level": "--log-level"}


class VllmArgsError(ValueError):
    """A vLLM flag given a value the engine cannot honour; the message names it."""


def normalize(args: Sequence[str], options: Mapping[str, bool]) -> tuple[list[str], list[str]]:
    """``args`` (after ``engine serve``) rewritten for ``engine serve``, and notes to log.

    ``options`` maps each long option the command declares to whether it takes a value.
    """
    out: list[str] = []
    notes: list[str] = []
    model: str | None = None
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("--") or token == "--":
            out.append(token)
            continue
        name, eq, inline = token.partition("=")
        name = RENAMED.get(name, name)
        if name == "--model":
            model, i = _value(args, i, name, inline if eq else None)
            continue
        if name in NO_OPS:
            takes_value, why = NO_OPS[name]
            if takes_value and not eq:
                _, i = _value(args, i, name, None)
            notes.append(f"{name} accepted and ignored: {why}")
            continue
        name = _expand(name, options)
        out.append(f"{name}={inline}" if eq else name)
    if model is not None:
        out.insert(0, model)
    return out, notes


def _value(args: Sequence[str], i: int, name: str, inline: str | None) -> tuple[str, int]:
    if inline is not None:
        return inline, i
    if i >= len(args):
        raise VllmArgsError(f"{name} needs a value")
    return args[i], i + 1


def _expand(name: str, options: Mapping[str, bool]) -> str:
    """A unique prefix of a declared option, expanded as argparse does (else as given)."""
    if name in options:
        return name
    matches = [option for option in options if option.startswith(name)]
    return matches[0] if len(matches) == 1 else name


def serve_options() -> dict[str, bool]:
    """``engine serve``'s long options and whether each takes a value, from the command."""
    import typer.main
    from infergate.engine.cli import app

    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    options: dict[str, bool] = {}
    for param in command.params:
        if param.param_type_name != "option":
            continue
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("--"):
                options[opt] = not param.is_flag
    return options
