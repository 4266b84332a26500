"""Command-line pre-check: one-line errors for unknown keys, group options and bad values.

Runs before Hydra composes anything, on the overrides as Hydra's own parser reads them, so that
``gpus=0``, ``problem=4d`` or ``gpuz=2`` stop at once with one line naming the key and the
allowed values (Hydra's own messages span several lines). Composed-config rules (tile window vs
image size, ...) are checked after composition by :func:`pnpscale.config.validate`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pnpscale.config import ConfigError, check_value, open_keys, schema_keys

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SWEEPS = ROOT / "sweeps"
GROUPS = ("problem", "mode", "cluster", "sweeps")


def group_options(group: str) -> list[str]:
    """Option names of a config group (yaml files of ``conf/<group>/``, or ``sweeps/``)."""
    folder = SWEEPS if group == "sweeps" else CONF / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _values(ov: Any) -> list[Any]:
    if ov.is_sweep_override():
        return list(ov.sweep_iterator())
    return [ov.value()]


def check_overrides(argv: Sequence[str]) -> None:
    """Check the command line's overrides.

    Raises:
        ConfigError: unknown key (with the closest known keys), unknown group option (with the
            options), or a value outside its rule (:data:`pnpscale.config.RULES`).
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args, _ = get_args_parser().parse_known_args(list(argv))
    parsed = OverridesParser.create().parse_overrides(args.overrides or [])
    known = set(schema_keys())
    for ov in parsed:
        key = ov.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if ov.is_delete():
            raise ConfigError(key, "~", "deleting keys is not supported")
        if key in GROUPS:
            options = group_options(key)
            for v in _values(ov):
                if v is not None and str(v) != "null" and str(v) not in options:
                    raise ConfigError(key, v, "allowed values: " + ", ".join(options))
            continue
        base = key.split("@")[0]
        free_form = any(base.startswith(k + ".") for k in open_keys())
        if base not in known and not free_form:
            close = difflib.get_close_matches(base, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            top = sorted(k for k in known if "." not in k)
            raise ConfigError(key, _show(ov), f"unknown key; {hint}top-level keys: {', '.join(top)}")
        if (ov.is_add() or ov.is_force_add()) and not free_form:
            raise ConfigError(key, _show(ov), f"'{base}' already exists: drop the leading '+'")
        for v in _values(ov):
            if isinstance(v, str) and v.startswith("${"):
                continue
            check_value(base, v)


def _show(ov: Any) -> str:
    try:
        return ov.get_value_element_as_str()
    except Exception:  # noqa: BLE001
        return "?"
