"""Command-line options declared once: on the dataclass fields they fill.

A field made with :func:`option` (or :func:`argument`) carries its flag names, help text
and typer settings (``min``, ``envvar``, ``hidden``…) in its metadata. :func:`command`
generates a typer command from the dataclass, one parameter per such field in field
order, and calls the function it wraps with the dataclass built from the parsed values.
Adding an option to a command is therefore adding one field; nothing else repeats it.

Where a flag's text is not the field's value (a duration like ``50ms``, ``FailOpen``),
the field names the command-line type (``cli_type``) and a ``convert`` function; a
``ValueError`` from it becomes click's usual "Invalid value for '--flag'" error. A field
made with :func:`options_group` holds a nested dataclass whose own option fields join the
command (``engine serve``'s ``--sim-*`` options build its :class:`TimingModel`), and
:func:`inherit` restates another dataclass's option under a new flag or default (``up``
passes several EPP and engine options through).

:func:`to_argv` goes the other way: the arguments that parse back into a given dataclass
(a field with ``convert`` names its inverse as ``render``). Whoever starts a process of
ours (``up`` its EPP, the operator its Deployment, the bench rigs) builds the options and
asks for the argv, so a flag's spelling lives only on its field.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand

__all__ = [
    "CliSpec",
    "SeveralValues",
    "argument",
    "cli_fields",
    "command",
    "inherit",
    "option",
    "options_group",
    "to_argv",
]

_KEY = "infergate.cli"
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class CliSpec:
    """How one dataclass field appears on the command line."""

    decls: tuple[str, ...]
    """Flag names (``"--port"``, ``"--x/--no-x"``); empty for an argument."""
    help: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    """Further ``typer.Option`` / ``typer.Argument`` keywords."""
    cli_type: Any = None
    """The command-line annotation when it is not the field's own type."""
    convert: Callable[[Any], Any] | None = None
    """Parsed command-line value → field value; ``ValueError`` is a usage error."""
    group: type | None = None
    """A nested options dataclass (see :func:`options_group`)."""
    cli_default: Any = field(default_factory=lambda: MISSING)
    """The command line's default when it is not the field's (``up`` serves TLS by
    default; a :class:`StackSpec` built in code does not)."""
    render: Callable[[Any], Any] | None = None
    """Field value → command-line text (or a list, one flag each): ``convert``'s inverse,
    for :func:`to_argv`; ``ValueError`` for a value the command line cannot carry."""
    several: bool = False
    """One flag takes every value up to the next option, as argparse's ``nargs='+'``
    (vLLM's ``--served-model-name a b``); the flag may repeat too. A list field, in a
    command registered with ``cls=SeveralValues``."""

    @property
    def is_argument(self) -> bool:
        return not self.decls and self.group is None


def option(
    *decls: str,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    help: str | None = None,
    cli_type: Any = None,
    convert: Callable[[Any], Any] | None = None,
    cli_default: Any = MISSING,
    render: Callable[[Any], Any] | None = None,
    several: bool = False,
    **settings: Any,
) -> Any:
    """A dataclass field that is also the option ``decls``."""
    spec = CliSpec(
        decls, help, settings, cli_type, convert, cli_default=cli_default, render=render,
        several=several,
    )  # fmt: skip
    return field(default=default, default_factory=default_factory, metadata={_KEY: spec})


def argument(*, help: str, **settings: Any) -> Any:
    """A required dataclass field that is a positional argument."""
    return field(metadata={_KEY: CliSpec((), help, settings)})


def options_group(cls: type) -> Any:
    """A field holding dataclass ``cls``, whose option fields join the command."""
    return field(default_factory=cls, metadata={_KEY: CliSpec((), group=cls)})


def inherit(source: type, name: str, *decls: str, help: str | None = None, **changes: Any) -> Any:
    """``source``'s option field ``name`` again, under ``decls`` (default: the same flags).

    ``help`` may embed the original as ``{help}``; ``changes`` override ``default`` and
    any other :func:`option` keyword.
    """
    original = next((f for f in dataclasses.fields(source) if f.name == name), None)
    if original is None or _KEY not in original.metadata:
        raise ValueError(f"{source.__name__}.{name} is not a command-line option")
    spec: CliSpec = original.metadata[_KEY]
    kwargs: dict[str, Any] = {
        "default": original.default,
        "default_factory": original.default_factory,
        "cli_type": spec.cli_type,
        "convert": spec.convert,
        "cli_default": spec.cli_default,
        "render": spec.render,
        "several": spec.several,
        **spec.settings,
    }
    if "default" in changes:
        kwargs["default_factory"] = MISSING
    if "default_factory" in changes:
        kwargs["default"] = MISSING
    kwargs.update(changes)
    text = spec.help if help is None else help.format(help=spec.help or "")
    return option(*(decls or spec.decls), help=text, **kwargs)


def cli_fields(cls: type) -> list[tuple[dataclasses.Field[Any], CliSpec]]:
    """The fields of ``cls`` that appear on the command line, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def _field_type(cls: type, f: dataclasses.Field[Any]) -> Any:
    """A field's annotation, evaluated (modules may use ``from __future__ import annotations``)."""
    if not isinstance(f.type, str):
        return f.type
    return eval(f.type, vars(sys.modules[cls.__module__]))  # our own annotations


def _cli_default(f: dataclasses.Field[Any], spec: CliSpec | None) -> Any:
    """What the command line fills in when the flag is absent (``MISSING``: required)."""
    if spec is not None and spec.cli_default is not MISSING:
        return spec.cli_default
    if f.default is not MISSING:
        return f.default
    if callable(f.default_factory):
        return f.default_factory()
    return MISSING


def _parameters(cls: type, prefix: str = "") -> list[inspect.Parameter]:
    params = []
    for f, spec in cli_fields(cls):
        if spec.group is not None:
            params += _parameters(spec.group, f"{prefix}{f.name}__")
            continue
        default = _cli_default(f, spec)
        if default is MISSING:
            default = inspect.Parameter.empty
        info = (
            typer.Argument(help=spec.help, **spec.settings)
            if spec.is_argument
            else typer.Option(*spec.decls, help=spec.help, **spec.settings)
        )
        annotation = spec.cli_type if spec.cli_type is not None else _field_type(cls, f)
        params.append(
            inspect.Parameter(
                prefix + f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=Annotated[annotation, info],
            )
        )
    return params


def build(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
    """``cls`` from parsed command-line ``values`` (keyed as :func:`command` names them)."""
    kwargs: dict[str, Any] = {}
    for f, spec in cli_fields(cls):
        if spec.group is not None:
            kwargs[f.name] = build(spec.group, values, f"{prefix}{f.name}__")
            continue
        value = values[prefix + f.name]
        if spec.convert is not None:
            try:
                value = spec.convert(value)
            except ValueError as error:
                hint = "/".join(spec.decls) or f.name.upper()
                raise typer.BadParameter(str(error), param_hint=f"'{hint}'") from None
        kwargs[f.name] = value
    return cls(**kwargs)


def command(cls: type[T]) -> Callable[[Callable[[T], R]], Callable[..., R]]:
    """Decorate ``run(options: cls)``: the result is a typer command whose parameters are
    ``cls``'s option fields; it builds ``cls`` from them and calls ``run``."""

    def wrap(run: Callable[[T], R]) -> Callable[..., R]:
        def cli(**values: Any) -> R:
            return run(build(cls, values))

        params = _parameters(cls)
        cli.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        cli.__annotations__ = {p.name: p.annotation for p in params}
        cli.__name__, cli.__qualname__ = run.__name__, run.__qualname__
        cli.__doc__, cli.__module__ = run.__doc__, run.__module__
        cli.several = frozenset(_several(cls))  # type: ignore[attr-defined]
        return cli

    return wrap


def _several(cls: type, prefix: str = "") -> list[str]:
    """The parameter names (as :func:`command` names them) of ``cls``'s ``several`` options."""
    names = []
    for f, spec in cli_fields(cls):
        if spec.group is not None:
            names += _several(spec.group, f"{prefix}{f.name}__")
        elif spec.several:
            names.append(prefix + f.name)
    return names


class SeveralValues(TyperCommand):
    """A command whose ``several`` options take each value up to the next option, as
    argparse's ``nargs='+'`` does (click takes one value per flag): ``--goodput ttft:200
    tpot:50`` parses as ``--goodput ttft:200 --goodput tpot:50``. Register a command made
    by :func:`command` with ``app.command(name, cls=SeveralValues)``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # command() sets it on the function; typer wraps that with functools.update_wrapper,
        # which copies it over.
        names: frozenset[str] = getattr(self.callback, "several", frozenset())
        return super().parse_args(ctx, spread_values(args, self.params, names))


def spread_values(
    args: Sequence[str], params: Sequence[Any], several: Collection[str]
) -> list[str]:
    """``args`` with each run of values after a ``several`` flag given one flag each.

    A run ends at the next token that starts with ``-``. If the command's required
    arguments would then go short, the runs give their last values back (one value each
    at least stays), so ``--served-model-name a MODEL_DIR`` still names ``MODEL_DIR``.
    ``params`` are the command's click parameters (typer's vendored click, hence ``Any``).
    """
    flags = {o for p in params if p.name in several for o in p.opts}
    options = [p for p in params if p.param_type_name == "option"]
    takes_value = {o for p in options if not p.is_flag and not p.count for o in p.opts}
    required = sum(p.nargs for p in params if p.param_type_name == "argument" and p.required)
    parts: list[list[str]] = []  # a run is [flag, value, ...]; any other part, plain tokens
    runs: list[list[str]] = []
    positional, i = 0, 0
    while i < len(args):
        token, i = args[i], i + 1
        if token == "--":
            parts.append(list(args[i - 1 :]))
            positional += len(args) - i
            break
        if token in flags:
            run = [token]
            while i < len(args) and not args[i].startswith("-"):
                run.append(args[i])
                i += 1
            if len(run) == 1:  # click would take the next option as the value
                raise typer.BadParameter("needs at least one value", param_hint=f"'{token}'")
            parts.append(run)
            runs.append(run)
        elif token in takes_value and i < len(args):
            parts.append([token, args[i]])
            i += 1
        else:
            parts.append([token])
            positional += not token.startswith("-")
    back = {id(run): 0 for run in runs}
    for run in reversed(runs):  # the last run gives back first
        while positional < required and len(run) - back[id(run)] > 2:
            back[id(run)] += 1
            positional += 1
    out: list[str] = []
    for part in parts:
        if id(part) not in back:
            out += part
            continue
        kept = len(part) - back[id(part)]
        out += [a for value in part[1:kept] for a in (part[0], value)] + part[kept:]
    return out


def to_argv(options: Any, *, always: Collection[str] = ()) -> list[str]:
    """The arguments that :func:`command` parses back into ``options`` (:func:`build`'s
    inverse): its arguments, then, in field order, each option whose value is not the
    command line's default, or whose field is named in ``always`` (an operator's pod spec
    names its ports). ``ValueError`` names a value no flag can carry (a field without a
    flag set in code, ``False`` for a flag without a ``--no-`` form)."""
    positional: list[str] = []
    flags: list[str] = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        spec: CliSpec | None = f.metadata.get(_KEY)
        if spec is not None and spec.group is not None:
            flags += to_argv(value, always=always)
        elif spec is None:
            if value != _cli_default(f, None):
                raise ValueError(f"{type(options).__name__}.{f.name} has no command-line flag")
        elif spec.is_argument:
            positional += _texts(spec, value)
        elif value != _parsed_default(f, spec) or f.name in always:
            flags += _flag_argv(spec, value)
    return [*positional, *flags]


def _parsed_default(f: dataclasses.Field[Any], spec: CliSpec) -> Any:
    """The field value the command line builds when the flag is absent."""
    default = _cli_default(f, spec)
    if spec.convert is None or default is MISSING:
        return default
    try:
        return spec.convert(default)
    except ValueError:
        return default


def _flag_argv(spec: CliSpec, value: Any) -> list[str]:
    """One option's arguments: ``--flag VALUE`` (once per item of a list), or the bare
    flag (or its ``--no-`` form) for a boolean."""
    flag, _, off = spec.decls[0].partition("/")
    if isinstance(value, bool) and spec.render is None:
        if value or off:
            return [flag if value else off]
        raise ValueError(f"{flag} has no form that sets it false")
    return [arg for text in _texts(spec, value) for arg in (flag, text)]


def _texts(spec: CliSpec, value: Any) -> list[str]:
    """A value as command-line text: rendered, one text per list item."""
    rendered = spec.render(value) if spec.render is not None else value
    items = rendered if isinstance(rendered, list | tuple) else [rendered]
    texts = []
    for item in items:
        if item is None:
            raise ValueError(f"{'/'.join(spec.decls) or 'argument'}: None has no text")
        texts.append(str(item.value if isinstance(item, enum.Enum) else item))
    return texts
