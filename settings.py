"""How settings reach a config dataclass: code or a flag > a ``TORCHVITALS_*`` variable >
the default.

    config = Config(**settings(Config, None, {"sample_every": 20},
                               lambda f: "TORCHVITALS_" + f.upper(), "torchvitals"))

Shared by the agent's, the collector's and the supervisor's configs, so every component reads
its environment and builds its flags the same way. Each field's help text is the docstring
written under it, so ``--help`` says what a flag does without a second copy of the words.
Torch-free.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import os
import textwrap
from collections.abc import Callable, Mapping
from typing import Any


def settings(
    cls: type,
    environ: Mapping[str, str] | None,
    overrides: Mapping[str, Any],
    env_key: Callable[[str], str],
    what: str,
    *,
    fields: Mapping[str, dataclasses.Field] | None = None,
) -> dict[str, Any]:
    """A config dataclass's values: its environment variables, then ``overrides`` on top.

    Args:
        cls: the dataclass.
        environ: the environment to read (default ``os.environ``).
        overrides: values given by flags or code (they win).
        env_key: field name -> its environment variable.
        what: the kind of setting, for the error about an unknown one.
        fields: name -> field of the settings, when they are not ``cls``'s own fields (a
            config made of sections lists its flat names here).

    Returns:
        Keyword arguments for ``cls``.

    Raises:
        TypeError: an override names no field.
        ValueError: a variable cannot be read as its field's type (the message names it).
    """
    environ = os.environ if environ is None else environ
    names = dict(fields) if fields is not None else {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(overrides) - set(names)
    if unknown:
        raise TypeError(
            f"unknown {what} setting(s): {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(names))}"
        )
    values: dict[str, Any] = {}
    for name, f in names.items():
        key = env_key(name)
        if key in environ:
            values[name] = _parse(environ[key], f, key)
    values.update(overrides)
    return values


def check_types(instance: Any, names: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigTypeError`` for the first field of the dataclass ``instance`` whose value
    is not of its annotated type (``int`` takes no bool or float, ``float`` takes an int, must be
    finite; ``X | None`` takes None); ``names`` maps a field to the name users know it by."""
    import math
    import typing

    from .errors import ConfigTypeError

    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        value, hint = getattr(instance, f.name), hints[f.name]
        allowed = _allowed(hint, value)
        if allowed is not None:
            raise ConfigTypeError((names or {}).get(f.name, f.name), value, allowed)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigTypeError((names or {}).get(f.name, f.name), value, "must be finite")


def _allowed(hint: Any, value: Any) -> str | None:
    """None when ``value`` fits ``hint``, else what the hint allows, for the message."""
    import collections.abc
    import types
    import typing

    options = (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else (hint,)
    )
    for option in options:
        origin = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return None
        if origin is bool and isinstance(value, bool):
            return None
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if origin is str and isinstance(value, str):
            return None
        if origin in (list, collections.abc.Sequence) and isinstance(value, (list, tuple)):
            return None
        if origin in (dict, collections.abc.Mapping) and isinstance(value, collections.abc.Mapping):
            return None
        if origin is typing.Any:
            return None
    names = []
    for option in options:
        origin = typing.get_origin(option) or option
        names.append("None" if option is type(None) else getattr(origin, "__name__", str(origin)))
    return "must be " + " or ".join(names)


def _parse(text: str, f: dataclasses.Field, key: str) -> Any:
    """Turn an environment string into the field's type, with an error naming the variable."""
    kind = str(f.type)
    try:
        if text.strip().lower() in ("", "none", "null") and "None" in kind:
            return None
        if kind.startswith("bool"):
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("str"):
            return text
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{key}={text!r}: cannot be read as {kind} ({exc})") from None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under the field in ``cls``'s source ("" if none)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen app): help without the words
        return {}
    node = tree.body[0]  # the class statement
    body = node.body if isinstance(node, ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    env_key: Callable[[str], str],
    skip: tuple[str, ...] = (),
) -> None:
    """One ``--field-name`` flag per field of ``cls`` (default None: "not given").

    The help is the field's docstring, its default and its variable, so a flag given neither
    on the command line nor in the environment visibly falls back to the default.
    """
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "none" if default is None else default
        help_text = f"{docs.get(f.name, '')} (default: {shown}; env {env_key(f.name)})".replace(
            "%", "%%"
        ).strip()
        flag = "--" + f.name.replace("_", "-")
        if kind.startswith("bool"):
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                default=None,
                help=help_text,
                metavar=f.name.upper(),
                type=int if kind.startswith("int") else float if kind.startswith("float") else str,
            )
