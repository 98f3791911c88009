"""Command-line options declared once: a dataclass field carries its flag, help text and bounds.

What it owns: the one way every ``ckpteval`` program turns an options dataclass into argparse flags and
back, and the one-line error convention of every parser.

* :func:`option` declares a field: ``steps: int = option(600, "training steps", min=1)``. The flag
  name defaults to ``--<field-name-with-dashes>``; the argparse type comes from the annotation (``int``,
  ``float``, ``str``, ``Path``, ``X | None``; ``bool`` is a switch, ``--no-x`` when the default is True;
  ``tuple[X, ...]``/``list[X]`` repeats unless ``parse`` reads one value; a ``Literal`` gives the choices);
  no help text: the field's docstring is its help. :func:`nested` declares a component (another options
  dataclass whose flags are its parent's: torchtitan's pattern); other fields are not flags.
* :func:`add_options` adds a dataclass's flags to a parser (argument groups by the ``group`` title);
  :func:`from_args` builds the dataclass from the parsed namespace (a repeatable flag given no times
  keeps the field's default); :func:`check_bounds` enforces the declared bounds on an instance built in
  Python (the API path), with the same message the command line gives.
* :class:`Parser` is ``argparse.ArgumentParser`` whose errors are **one line** on stderr
  (``ckpteval train: error: argument --steps: must be >= 1, got 0 (see --help)``) and exit 2; every
  ``ckpteval`` parser is one, so a usage error never prints a usage block or a traceback.

* :func:`output_width` and :func:`wrap`: the width every program's text output fits (``COLUMNS``, the
  terminal's, 80 when piped) and lines broken between words to fit it.

Bounds: ``min`` (>=) and ``gt`` (>) on numbers; every float must be finite (NaN and inf are refused).
Adding a flag to a program is adding one field. Limits: cross-flag rules (``--save-hf`` needs
``--save-interval``) stay in the program's own ``validate``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import re
import shutil
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

META_KEY = "ckpteval_flag"
NESTED_KEY = "ckpteval_nested"


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    gt: float | None = None
    parse: Callable[[str], Any] | None = None
    group: str | None = None
    show_default: bool = True


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[Any] | None = None,
    min: float | None = None,
    gt: float | None = None,
    parse: Callable[[str], Any] | None = None,
    group: str | None = None,
    show_default: bool = True,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    meta = {META_KEY: Flag(help, flag, metavar, tuple(choices) if choices else None, min, gt, parse, group,
                           show_default)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def nested(cls: type) -> Any:  # a field holding options dataclass ``cls`` (default ``cls()``), flags its parent's
    return dataclasses.field(default_factory=cls, metadata={NESTED_KEY: cls})


def components(cls: type) -> list[tuple[str, type]]:  # the nested() fields: (name, options dataclass)
    return [(f.name, f.metadata[NESTED_KEY]) for f in dataclasses.fields(cls) if NESTED_KEY in f.metadata]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of ``cls``'s fields (the string literal right below a field), one line each."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):  # no source (a frozen app): the flags keep their explicit help texts
        return {}
    return {f.target.id: " ".join(d.value.value.split()) for f, d in zip(body, body[1:], strict=False)
            if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name) and isinstance(d, ast.Expr)
            and isinstance(d.value, ast.Constant) and isinstance(d.value.value, str)}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit 2; a description taken from a
    module docstring loses its reStructuredText quotes (````ckpteval x````) in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(kwargs.get("description"), str):
            kwargs["description"] = kwargs["description"].replace("``", "")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message = _bound_message(" ".join(message.split()))
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bound_message(message: str) -> str:
    """argparse's ``argument --x: must be >= 1, got 0`` reads as ``--x must be >= 1, got 0`` (as check_bounds says)."""
    m = re.match(r"^argument (-\S+?)(?:/\S+)?: (must .*)$", message)
    return f"{m.group(1)} {m.group(2)}" if m else message


class RaisingParser(Parser):
    """A parser whose errors are ValueErrors (for checking another program's arguments without exiting)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{self.prog}: {_bound_message(' '.join(message.split()))}")


def parse_as(cls: type, argv: Sequence[str], what: str) -> Any:
    """``argv`` parsed with the flags of options dataclass ``cls`` and bounds-checked; ValueError names
    ``what`` and the flag (used to check arguments handed on to another program before starting it)."""
    parser = RaisingParser(prog=what, add_help=False)
    add_options(parser, cls)
    obj = from_args(cls, parser.parse_args(list(argv)))
    check_bounds(obj)
    return obj


def fail(prog: str, error: str | BaseException, code: int = 2) -> int:
    """Print one ``prog: message`` line on stderr and return ``code`` (for errors found after parsing).

    An ``OSError`` with a file name reads ``<file>: <reason>`` (``PermissionError`` from an unreadable
    run dir names the dir, not a traceback).
    """
    message = str(error)
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        message = f"{error.filename}: {error.strerror.lower()}"
    print(f"{prog}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


def output_width() -> int:
    """The columns text output must fit: ``COLUMNS`` when set, else the terminal's, else 80 (a pipe, a log)."""
    return shutil.get_terminal_size((80, 24)).columns


def wrap(text: str, width: int) -> list[str]:
    """``text`` as lines of at most ``width`` columns, broken at spaces only (a longer word — a path, a run
    id — stays whole on its own line); continuation lines are indented two spaces."""
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False, subsequent_indent="  ") or [text]


# ------------------------------------------------------------------------------------------- values
def bounded(kind: Callable[[str], Any], *, min: float | None = None, gt: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` parsing ``kind`` and refusing non-finite floats and values out of bounds."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {_kind_word(kind)} value: {text!r}") from None
        problem = bound_problem(value, min=min, gt=gt)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def bound_problem(value: Any, *, min: float | None = None, gt: float | None = None) -> str | None:
    """Why ``value`` breaks the bounds (None if it does not)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if min is not None and value < min:
        return f"must be >= {min:g}, got {value}"
    if gt is not None and value <= gt:
        return f"must be > {gt:g}, got {value}"
    return None


def _kind_word(kind: Callable[[str], Any]) -> str:
    return {int: "integer", float: "number", Path: "path"}.get(kind, getattr(kind, "__name__", "value"))  # type: ignore[call-overload]


positive_int = bounded(int, min=1)
non_negative_int = bounded(int, min=0)
positive_float = bounded(float, gt=0)


def http_url(text: str) -> str:
    """An argparse ``type`` for a service's base URL (a judge's): ``http://`` or ``https://`` with a host."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("http", "https") or not rest.split("/", 1)[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an http(s) URL such as http://host:8000/v1")
    return text


# ------------------------------------------------------------------------------------------- fields
@dataclasses.dataclass(frozen=True)
class _Spec:
    field: dataclasses.Field[Any]
    meta: Flag
    base: Any  # the scalar type (int, float, str, Path, bool)
    repeat: bool  # tuple/list: a repeatable flag
    container: type | None
    help: str  # the option's, else the field's docstring
    choices: tuple[Any, ...] | None  # the option's, else the Literal's

    @property
    def flag(self) -> str:
        return self.meta.flag or "--" + self.field.name.replace("_", "-")

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return dataclasses.MISSING


def _unwrap(hint: Any) -> tuple[Any, bool, type | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return _unwrap(args[0])
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return args[0], True, origin
    return (type(args[0]) if origin is typing.Literal else hint), False, None


def specs(cls: type) -> list[_Spec]:
    """The flag fields of dataclass ``cls``, in declaration order."""
    namespace = vars(sys.modules[cls.__module__])
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(META_KEY)
        if meta is None:
            continue  # not a flag; its annotation is never evaluated (it may name a torch-side type)
        hint = eval(f.type, namespace) if isinstance(f.type, str) else f.type  # noqa: S307 (our own source)
        base, repeat, container = _unwrap(hint)
        help_text = meta.help or field_docs(cls).get(f.name, "")
        if not help_text:
            raise ValueError(f"{cls.__name__}.{f.name}: every flag needs a help text or a docstring")
        literal = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        out.append(_Spec(f, meta, base, repeat and meta.parse is None, container, help_text, meta.choices or literal))
    return out


def _help(spec: _Spec) -> str:
    text = spec.help.replace("%", "%%")
    default = spec.default
    shown = spec.meta.show_default and not (default is None or isinstance(default, bool) or default in ((), [])
                                            or default is dataclasses.MISSING)
    if shown and "default" not in text:
        value = ",".join(map(str, default)) if isinstance(default, tuple | list) else default
        text += f" (default: {value})"
    return text


def add_options(
    parser: argparse.ArgumentParser, cls: type, *, exclude: Sequence[str] = (), only: Sequence[str] | None = None
) -> None:
    """Add the flags of dataclass ``cls`` and its :func:`nested` components to ``parser`` (but those in
    ``exclude``), one argument group per ``group`` title."""
    groups = {g.title: g for g in parser._action_groups if g.title}
    for spec in specs(cls):
        name = spec.field.name
        if name in exclude or (only is not None and name not in only):
            continue
        meta = spec.meta
        target: Any = parser
        if meta.group:
            target = groups.get(meta.group) or groups.setdefault(meta.group, parser.add_argument_group(meta.group))
        kw: dict[str, Any] = {"dest": name, "help": _help(spec)}
        if spec.base is bool and not spec.repeat:
            kw["action"] = "store_false" if spec.default is True else "store_true"
            target.add_argument(spec.flag, **kw)
            continue
        kind = meta.parse or spec.base
        kw["type"] = bounded(kind, min=meta.min, gt=meta.gt) if kind in (int, float) else kind
        if meta.metavar:
            kw["metavar"] = meta.metavar
        if spec.choices:
            kw["choices"] = spec.choices
        if spec.default is dataclasses.MISSING:
            kw["required"] = True
        if spec.repeat:
            kw["action"] = "append"
        kw["default"] = None  # from_args fills in the field's own default: declared once
        target.add_argument(spec.flag, **kw)
    for _name, component in components(cls):
        add_options(parser, component, exclude=exclude, only=only)


def from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """Build ``cls`` from parsed flags; a flag not given (or excluded) keeps the field's default."""
    values: dict[str, Any] = {}
    for spec in specs(cls):
        name = spec.field.name
        value = getattr(args, name, None)
        if value is None:
            continue
        if spec.container is not None and isinstance(value, list | tuple):
            value = spec.container(value)
        values[name] = value
    for name, component in components(cls):
        values[name] = from_args(component, args)
    values.update(fixed)
    return cls(**values)


def check_bounds(obj: Any, fields: bool = False) -> None:
    """Enforce the declared bounds and choices on a dataclass built in Python (ValueError names the flag;
    with ``fields``, the field and its flag: ``max_in_flight (--eval-max-in-flight) must be >= 1, got 0``)."""
    for spec in specs(type(obj)):
        label = f"{spec.field.name} ({spec.flag})" if fields else spec.flag
        value = getattr(obj, spec.field.name)
        if value is None or isinstance(value, bool):
            continue
        values = value if spec.repeat else (value,)
        for v in values:
            if spec.choices and v not in spec.choices:
                raise ValueError(f"{label} must be one of {', '.join(map(str, spec.choices))}, got {v!r}")
            if isinstance(v, int | float):
                problem = bound_problem(v, min=spec.meta.min, gt=spec.meta.gt)
                if problem:
                    raise ValueError(f"{label} {problem}")
    for name, _component in components(type(obj)):
        check_bounds(getattr(obj, name), fields)


# ---------------------------------------------------------------------------------------- the run dir
RUN_DIR_HELP = "the run directory (holds run.json)"


def add_run_dir_argument(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """The run dir of a reading command, given either way: positional ``RUN`` or ``--run-dir RUN``
    (every other command takes ``--run-dir``); :func:`run_dir_from_args` checks exactly one was given.
    ``many``: the command also takes several runs positionally (``RUN [RUN ...]``, read with
    :func:`run_dirs_from_args`)."""
    help_text = RUN_DIR_HELP + ("; several RUNs show the runs side by side" if many else "")
    parser.add_argument("run_dir_pos", nargs="*" if many else "?", type=Path, metavar="RUN", help=help_text)
    parser.add_argument("--run-dir", type=Path, metavar="RUN", help="the same, as a flag")


def accept_positional_run_dir(parser: argparse.ArgumentParser) -> None:
    """A command declaring ``--run-dir`` (an options dataclass field) also takes the run dir positionally,
    as ``status RUN`` and ``plot RUN`` do; call :func:`run_dir_from_args` after parsing."""
    action = next(a for a in parser._actions if "--run-dir" in a.option_strings)
    parser.set_defaults(run_dir_required=action.required)
    action.required = False
    parser.add_argument("run_dir_pos", nargs="?", type=Path, metavar="RUN", help="the same as --run-dir RUN")


def run_dir_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """The one run dir given positionally or as ``--run-dir`` (a usage error when two differ, or none is
    given and the command needs one); also stored as ``args.run_dir``."""
    given = [Path(p) for p in (args.run_dir_pos, args.run_dir) if p is not None]
    return _one_run_dir(parser, args, given)


def run_dirs_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Path]:
    """The run dirs of a ``many`` command (:func:`add_run_dir_argument`): several positionally, or one
    as ``--run-dir`` (the same usage errors as :func:`run_dir_from_args` when one run is meant)."""
    positional = [Path(p) for p in args.run_dir_pos or []]
    if len(positional) > 1:
        if args.run_dir is not None:
            parser.error(f"--run-dir {args.run_dir} beside several RUNs: give the runs positionally")
        args.run_dir = positional[0]
        return positional
    given = [*positional, *([Path(args.run_dir)] if args.run_dir is not None else [])]
    return [_one_run_dir(parser, args, given)]


def _one_run_dir(parser: argparse.ArgumentParser, args: argparse.Namespace, given: list[Path]) -> Path:
    if not given and getattr(args, "run_dir_required", True):
        parser.error("the run directory is required: give RUN or --run-dir RUN")
    if len(given) == 2 and given[0] != given[1]:
        parser.error(f"two run directories given ({given[0]} and --run-dir {given[1]}): give one")
    args.run_dir = given[0] if given else None
    return args.run_dir
