"""Plugins named in the config: a problem, a mode (solver) or a cluster backend is ``impl: module:Class``.

The registries are the config groups themselves (``conf/{problem,mode,cluster}/*.yaml``, plus
any folder on ``hydra.searchpath``): each option's YAML names its class, imported only when used. Adding
one is its class and its YAML, no edit of pnpscale.

Each plugin owns its parameter schema next to its class (a dataclass: a problem's ``params``, a mode's
``params``, a cluster backend's ``params``) and its value rules (``rules``); :func:`check_params` checks
a config node against them before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pnpscale.core.config import ConfigError

T = TypeVar("T")


def resolve_impl(key: str, impl: str, base: type[T]) -> type[T]:
    """Import ``"package.module:Class"`` and return the class, a subclass of ``base``.

    Args:
        key: the config key that named it (``"problem.impl"``, ``"mode.impl"``, ``"cluster.impl"``).
        impl: ``"package.module:Class"``.
        base: the class it must derive from.

    Raises:
        ConfigError: malformed string, missing module or attribute, or not a subclass of ``base``
            (one line naming ``key``).

    >>> resolve_impl("x.impl", "collections:OrderedDict", dict).__name__
    'OrderedDict'
    >>> resolve_impl("x.impl", "collections:OrderedDict", list)
    Traceback (most recent call last):
    ...
    pnpscale.core.config.ConfigError: x.impl=collections:OrderedDict: not a subclass of builtins.list
    """
    module_name, sep, attr = str(impl).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(key, impl, "must be 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, impl, f"cannot import {module_name} ({exc})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(key, impl, f"{module_name} has no attribute {attr}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(key, impl, f"not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


#: A value rule: (accepts the value?, what is allowed), as :data:`pnpscale.core.config.RULES`.
Rule = tuple[Callable[[Any], bool], str]


def params_keys(schema: type | None) -> tuple[str, ...]:
    """The keys of a plugin's parameter schema (a dataclass; ``None``: the plugin has none).

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class P:
    ...     lr: float = 1e-4
    >>> params_keys(P), params_keys(None)
    (('lr',), ())
    """
    return tuple(f.name for f in dataclasses.fields(schema)) if schema is not None else ()


def check_params(
    prefix: str, schema: type | None, rules: Mapping[str, Rule], values: Mapping[str, Any], owner: str
) -> None:
    """A plugin's own parameters (``problem.params``, ``mode.params``) against the plugin's schema.

    Args:
        prefix: the config node, e.g. ``"mode.params"``.
        schema: the plugin's parameter dataclass (its fields are the keys, with their defaults), or ``None``.
        rules: value rules of those keys (``"lr" -> (ok, allowed)``); a key's rule replaces its type check, so it
            must refuse a value of the wrong type itself (and never raise).
        values: the node's composed values.
        owner: the plugin, for the messages (``"mode=training"``).

    Raises:
        ConfigError: one line naming the key: an unknown key (with the closest known ones and every key of the
            plugin, or "none"), a value outside its rule, or (a key without a rule) of the wrong type (``bool``,
            ``int``, ``float``, ``str``, ``list``, ``dict``; ``X | None`` also takes ``null``).

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class P:
    ...     lr: float = 1e-4
    >>> check_params("mode.params", P, {}, {"lr": 0.1}, "mode=training")
    >>> try:
    ...     check_params("mode.params", P, {}, {"lrr": 0.1}, "mode=training")
    ... except ConfigError as exc:
    ...     print(exc)
    mode.params.lrr=0.1: unknown key for mode=training; did you mean mode.params.lr? its keys: lr
    """
    known = params_keys(schema)
    hints = typing.get_type_hints(schema) if schema is not None else {}
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=2)
            hint = f"did you mean {', '.join(f'{prefix}.{c}' for c in close)}? " if close else ""
            raise ConfigError(name, value, f"unknown key for {owner}; {hint}its keys: {', '.join(known) or 'none'}")
        rule = rules.get(key) or _type_rule(hints.get(key))
        if rule is not None and not rule[0](value):
            raise ConfigError(name, value, rule[1])


def params_values(schema: type | None, values: Mapping[str, Any]) -> Any:
    """The schema's instance: ``values`` over the dataclass defaults (check them first: :func:`check_params`).

    Returns:
        an instance of ``schema``, or ``None`` when ``schema`` is ``None``.
    """
    return schema(**dict(values)) if schema is not None else None


_SCALARS: dict[type, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "must be true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "must be an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "must be a number"),
    str: (lambda v: isinstance(v, str), "must be a string"),
    list: (lambda v: isinstance(v, (list, tuple)), "must be a list"),
    dict: (lambda v: isinstance(v, Mapping), "must be a mapping"),
}


def _type_rule(hint: Any) -> tuple[Callable[[Any], bool], str] | None:
    """The rule of a field's type hint (``None``: a type this check does not know, accepted)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        inner = _type_rule(args[0])
        return None if inner is None else ((lambda v: v is None or inner[0](v)), inner[1] + ", or null")
    base = typing.get_origin(hint) or hint
    return _SCALARS.get(base) if isinstance(base, type) else None
