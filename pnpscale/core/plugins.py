"""Plugins named in the config: a problem, a mode (solver) or a cluster backend is ``impl: module:Class``.

The registries are the config groups themselves (``pnpscale/conf/{problem,mode,cluster}/*.yaml``, plus
any folder on ``hydra.searchpath``): each option's YAML names its class, imported only when used. Adding
one is its class and its YAML, no edit of pnpscale.
"""

from __future__ import annotations

import importlib
from typing import TypeVar

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
