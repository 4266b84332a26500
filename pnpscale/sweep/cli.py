"""Command-line pre-check: one-line errors for unknown keys, group options and bad values.

Runs before Hydra composes anything, on the overrides as Hydra's own parser reads them, so that
``gpus=0``, ``problem=4d`` or ``gpuz=2`` stop at once with one line naming the key and the
allowed values (Hydra's own messages span several lines). Composed-config rules (tile window vs
image size, ...) are checked after composition by :func:`pnpscale.core.config.validate`.
"""

from __future__ import annotations

import difflib
import functools
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pnpscale.cluster import cluster_backends
from pnpscale.core.config import (
    CONF_DIR,
    SWEEPS_DIR,
    ConfigError,
    check_type,
    check_value,
    cuda_surely_absent,
    moved_key_error,
    open_keys,
    register_schema,
    schema_keys,
    validate,
)
from pnpscale.core.errors import InputError
from pnpscale.core.lock import in_use
from pnpscale.sweep.point import check_room, mode_key_problems, resolve_point, writable_dir

#: The app's Hydra config tree (``conf/`` of a checkout; ``pnpscale/conf`` in a wheel, see CONF_DIR).
CONF = CONF_DIR
#: The stored sweeps, group ``sweeps`` (``sweeps/`` of a checkout; ``pnpscale/conf/sweeps`` in a wheel).
SWEEPS = SWEEPS_DIR
GROUPS = ("problem", "mode", "cluster", "sweeps")


def group_options(group: str, search_dirs: Sequence[Path] = ()) -> list[str]:
    """Option names of a config group: yaml files of ``conf/<group>/`` (``sweeps/`` for the stored sweeps), plus
    ``<dir>/<group>/`` of every extra config folder on ``hydra.searchpath`` (a user's own problems)."""
    folders = [SWEEPS if group == "sweeps" else CONF / group, *(Path(d) / group for d in search_dirs)]
    return sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})


def search_dirs(parsed: Sequence[Any]) -> list[Path]:
    """Local folders named by a ``hydra.searchpath=[file://...]`` override (``pkg://`` entries are skipped)."""
    out: list[Path] = []
    for ov in parsed:
        if ov.key_or_group == "hydra.searchpath" and not ov.is_sweep_override():
            for entry in ov.value() or []:
                if str(entry).startswith("file://"):
                    out.append(Path(str(entry).removeprefix("file://")))
    return out


def _values(ov: Any) -> list[Any]:
    if ov.is_sweep_override():
        return list(ov.sweep_iterator())
    return [ov.value()]


class CommandLineError(InputError, ValueError):
    """Every problem found on a command line, one line each (``str()`` joins them)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def check_overrides(argv: Sequence[str]) -> None:
    """Check the command line's overrides, all of them.

    Raises:
        CommandLineError: one line per problem: overrides on both sides of a flag (``scale=tiny -m gpus=1,2``,
            which Hydra's parser would refuse with its usage), an override Hydra cannot parse, an unknown key
            (with the closest known keys), an unknown group option (with the options), or a value
            outside its rule (:data:`pnpscale.core.config.RULES`), each sweep value checked.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    args, unread = get_args_parser().parse_known_args(list(argv))
    stray = [a for a in unread if not a.startswith("-")]
    if stray:  # overrides after a flag that follows other overrides: Hydra's parser takes one run of them
        flags = [a for a in argv if a.startswith("-")]
        hint = ""
        if set(flags) <= {"-m", "--multirun"}:
            hint = ": python -m pnpscale " + " ".join([*flags, *(a for a in argv if not a.startswith("-"))])
        raise CommandLineError([f"{' '.join(stray)}: overrides must all come after the flags ({' '.join(flags)})"
                                + hint])  # fmt: skip
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides or [])
    except OverrideParseException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "cannot be parsed"
        raise CommandLineError([f"could not parse the overrides: {first}"]) from None
    known = set(schema_keys())
    extra = search_dirs(parsed)
    backends: dict[str, Any] = {}
    elsewhere: dict[str, list[str]] = {}  # cluster.<key> -> the other backends that have it
    if any(ov.key_or_group.startswith("cluster.") for ov in parsed):  # the backends' own keys and rules

        backends = cluster_backends(extra)
        chosen = _chosen_cluster(parsed)
        if chosen in backends:  # only the chosen backend's keys (a slurm key on cluster=local is refused)
            for name, b in backends.items():
                for k in b.keys():
                    if name != chosen and k not in backends[chosen].keys():
                        elsewhere.setdefault(f"cluster.{k}", []).append(f"cluster={name}")
            backends = {chosen: backends[chosen]}
        known |= {f"cluster.{k}" for b in backends.values() for k in b.keys()}
    problems: list[str] = []
    for ov in parsed:
        owned = next((k for k in elsewhere if ov.key_or_group == k or ov.key_or_group.startswith(k + ".")), None)
        if owned is not None:
            (name,) = backends
            owners = " or ".join(elsewhere[owned])
            problems.append(str(ConfigError(ov.key_or_group, _show(ov), f"a key of {owners}, not of cluster={name}")))
            continue
        try:
            _check_one(ov, known, extra, backends)
        except ConfigError as exc:
            problems.append(str(exc))
        except CommandLineError as exc:
            problems.extend(exc.problems)
    if problems:
        raise CommandLineError(problems)


def _chosen_cluster(parsed: Sequence[Any]) -> str | None:
    """The ``cluster`` option the command line selects (``local``, the default, when none and no stored sweep
    is named), or ``None`` when it cannot be told before composing (a sweep over it, a stored sweep)."""
    chosen = [ov for ov in parsed if ov.key_or_group == "cluster"]
    if chosen:
        return None if chosen[-1].is_sweep_override() else str(chosen[-1].value())
    return None if any(ov.key_or_group == "sweeps" for ov in parsed) else "local"


#: Hydra output folders a user may set on the command line (checked like ``output.root``).
HYDRA_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


def check_hydra_override(key: str, value: Any) -> None:
    """The ``hydra.*`` overrides that decide where files go.

    ``hydra.run.dir`` / ``hydra.sweep.dir`` must be (or be creatable as) a folder this user can write
    (checked up to the first ``${...}``); ``hydra.sweep.subdir`` must stay inside the sweep folder
    (relative, no ``..``) and name a sub-folder of it (not ``.``: the sweep's own folder and lock);
    ``hydra.job.name`` (the log file's name) must be a plain file name.

    Raises:
        ConfigError: one line naming the key, the value and the rule.
    """
    from pathlib import PurePosixPath

    problem = hydra_key_problem(key)
    if problem is not None:
        raise ConfigError(key, value, problem)
    text = "" if value is None else str(value)
    if key in HYDRA_DIRS:
        if not text.strip():
            raise ConfigError(key, "''", "must name a folder (empty would write the run into the current folder)")
        static = text.split("${", 1)[0]
        if static and not writable_dir(Path(static)):
            raise ConfigError(key, text, "must be a folder this user can create and write")
    elif key == "hydra.sweep.subdir":
        parts = PurePosixPath(text).parts
        if PurePosixPath(text).is_absolute() or ".." in parts:
            raise ConfigError(key, text, "must stay inside the sweep folder: a relative path without '..'")
        if not parts and "${" not in text:
            raise ConfigError(key, text, "must name a sub-folder of the sweep folder (each point has its own), "
                              "e.g. the default problem=${problem.name}/mode=${mode.name}/gpus=${gpus}")  # fmt: skip
    elif key == "hydra.job.name":
        if not text or "/" in text or text in (".", "..") or "\0" in text:
            raise ConfigError(key, text, "must be a plain file name (no '/', not '..'): it names the log file")


@functools.cache
def _hydra_schema() -> Any:
    """Hydra's own config schema as a (read-only) structured config, built once: the launcher checks two
    ``hydra.*`` keys of every sweep point."""
    from hydra.conf import HydraConf
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(HydraConf)
    OmegaConf.set_readonly(schema, True)
    return schema


def hydra_key_problem(key: str) -> str | None:
    """Why a dotted ``hydra.*`` key names nothing in Hydra's own schema (:class:`hydra.conf.HydraConf`), e.g.
    ``hydra.run.dri``; ``None`` when it does, or when it goes below a node the schema leaves open (a dict such
    as ``hydra.job.env_set``, or a node the chosen plugin fills: ``hydra.launcher``, ``hydra.sweeper``, the
    logging configs), which Hydra checks itself. Group keys (``hydra/launcher=...``) are not looked at.

    >>> hydra_key_problem("hydra.run.dri")
    'unknown key; did you mean hydra.run.dir? keys of hydra.run: dir'
    >>> hydra_key_problem("hydra.sweep.subdir"), hydra_key_problem("hydra.job.env_set.OMP_NUM_THREADS")
    (None, None)
    >>> hydra_key_problem("hydra.launcher.timeout_min") is None
    True
    """
    import dataclasses

    from omegaconf import DictConfig

    if not key.startswith("hydra."):
        return None
    node: Any = _hydra_schema()
    path = "hydra"
    for part in key.split(".")[1:]:
        kind = node._metadata.object_type if isinstance(node, DictConfig) else None
        if kind is None or not dataclasses.is_dataclass(kind) or node._is_missing():
            return None  # open below here (a dict, a value a plugin fills), or a leaf: Hydra says the rest
        fields = list(node.keys())
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=3)
            hint = f"did you mean {', '.join(f'{path}.{c}' for c in close)}? " if close else ""
            return f"unknown key; {hint}keys of {path}: {', '.join(fields)}"
        node = node._get_node(part)
        path = f"{path}.{part}"
    return None


def top_level_keys(known: set[str] | None = None) -> list[str]:
    """Every key a command line may start with: the schema's top-level fields and the config groups of
    ``conf/`` and ``sweeps`` (which has no schema field), derived, never listed by hand.

    >>> {"gpus", "problem", "sweeps", "resume"} <= set(top_level_keys())
    True
    """
    keys = set(schema_keys()) if known is None else known
    groups = {p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))} | {"sweeps"}
    return sorted({k for k in keys if "." not in k} | groups)


def _check_one(ov: Any, known: set[str], extra: Sequence[Path] = (), backends: Mapping[str, Any] | None = None) -> None:
    key = ov.key_or_group
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        for v in _values(ov):
            check_hydra_override(key, v)
        return
    if ov.is_delete():
        raise ConfigError(key, "~", "deleting keys is not supported")
    if key in GROUPS:
        options = group_options(key, extra)
        bad = [v for v in _values(ov) if v is not None and str(v) != "null" and str(v) not in options]
        if bad:
            raise CommandLineError([str(ConfigError(key, v, "allowed values: " + ", ".join(options))) for v in bad])
        return
    base = key.split("@")[0]
    moved = moved_key_error(base, str(ov.input_line).partition("=")[2] if ov.input_line else _show(ov))
    if moved is not None:  # a key the shared schema held before its plugin owned it
        raise moved
    own_open = [f"cluster.{k}" for b in (backends or {}).values() for k in b.open_keys]
    free_form = any(base.startswith(k + ".") for k in (*open_keys(), *own_open))
    if base not in known and not free_form:
        close = difflib.get_close_matches(base, sorted(known), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        top = top_level_keys(known)
        raise ConfigError(key, _show(ov), f"unknown key; {hint}top-level keys: {', '.join(top)}")
    if (ov.is_add() or ov.is_force_add()) and not free_form:
        raise ConfigError(key, _show(ov), f"'{base}' already exists: drop the leading '+'")
    problems = []
    for v in _values(ov):
        if isinstance(v, str) and v.startswith("${"):
            continue
        try:
            check_value(base, v)
            if base.startswith("cluster."):  # a backend's own rule (every backend declaring the key)
                for backend in (backends or {}).values():
                    if base.removeprefix("cluster.") in backend.rules:
                        backend.check_value(base.removeprefix("cluster."), v)
            # a value OmegaConf cannot convert to the schema's type (Hydra's merge would print a traceback)
            check_type(base, v)
            if base.startswith("cluster."):
                for backend in (backends or {}).values():
                    if backend.params is not None:
                        check_type(base.removeprefix("cluster."), v, backend.params)
        except ConfigError as exc:
            problems.append(str(exc))
    if base == "output.root" and not ov.is_sweep_override() and not writable_dir(Path(str(ov.value()))):
        problems.append(str(ConfigError(base, ov.value(), "must be a folder this user can create and write")))
    if problems:
        raise CommandLineError(problems)


def compose_config(overrides: Sequence[str]) -> Any:
    """pnpscale's composed config for ``overrides`` (Hydra's compose API, schema registered).

    ``hydra.*`` overrides are left out (they shape Hydra's run, not the point), except
    ``hydra.searchpath``, which can add config groups options (a user's own problem).
    """
    from hydra import compose, initialize_config_dir


    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            return compose("config", overrides=[o for o in overrides if _keeps(o)])
        except Exception as exc:
            refused = file_key_error(exc)
            if refused is None:
                raise
            raise refused from None


def file_key_error(exc: BaseException) -> InputError | None:
    """One line for a key a config file (or an override without ``+``) sets that the schema does not have (Hydra's
    ``ConfigCompositionException`` over OmegaConf's ``ConfigKeyError`` / ``ConfigAttributeError``, read by its
    ``full_key``), naming the new place of a moved key
    (:data:`pnpscale.core.config.MOVED_KEYS`) or the node's keys; ``None`` for any other error.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__ or exc.__context__
    key = getattr(cause, "full_key", None)
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or not key:
        return None
    moved = moved_key_error(str(key), "(set in a config file)")
    if moved is not None:
        return moved
    parent = str(key).rpartition(".")[0]
    if parent in open_keys():  # a plugin's own node: its YAML does not set the key (the class's check decides)
        group = parent.split(".")[0]
        return ConfigError(
            str(key),
            "?",
            f"the {group} option's YAML sets no such key (its class's keys are set there: "
            f"python -m pnpscale --cfg job shows them); +{key}=<value> adds it for the class to check",
        )
    keys = sorted(k.removeprefix(parent + ".") for k in schema_keys() if k.rpartition(".")[0] == parent)
    return ConfigError(str(key), "(set in a config file)", f"unknown key; its node's keys: {', '.join(keys)}")


def _keeps(override: str) -> bool:
    key = override.lstrip("+~")
    return not key.startswith("hydra") or key.startswith("hydra.searchpath")


def check_single_point(argv: Sequence[str]) -> None:
    """For a single run (no sweep), compose the point and run every value rule before Hydra starts.

    Sweeps (``-m``, comma lists, ``sweeps=``, ``cluster=slurm``) are checked by the launcher, point
    by point, before any runs (their shared part first, when a user's config folder is on the search path:
    :func:`check_sweep_files`); ``--cfg``/``--help``/``--info`` run nothing and are not checked.

    Raises:
        CommandLineError: ``-m`` with ``--cfg``/``--info``, a list of values (a sweep) without ``-m``, or a
            key that the point's mode does not read (``problem.unroll`` in inference:
            :func:`pnpscale.sweep.point.mode_key_problems`).
        ConfigError: see :func:`pnpscale.sweep.point.resolve_point`.
        NoSpace: the run folder's disk cannot hold even the point's status record
            (:func:`pnpscale.sweep.point.check_room`; exit 1).
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args, _ = get_args_parser().parse_known_args(list(argv))
    shows = [
        f for f, on in (("--cfg", args.cfg), ("--info", args.info), ("--shell-completion", args.shell_completion)) if on
    ]
    if args.multirun and shows:
        raise CommandLineError(
            [f"-m (--multirun) and {shows[0]} cannot be combined: drop -m to print the config of one point "
             f"(python -m pnpscale {shows[0]} job gpus=2), or drop {shows[0]} to run the sweep"]
        )  # fmt: skip
    if shows or args.help or args.hydra_help:
        return
    overrides = list(args.overrides or [])
    parsed = OverridesParser.create().parse_overrides(overrides)
    if args.multirun:
        check_sweep_files(parsed)
        return
    multirun = any(
        ov.key_or_group == "sweeps" or (ov.key_or_group == "hydra.mode" and str(ov.value()) == "MULTIRUN")
        for ov in parsed
    )  # a stored sweep sets hydra.mode=MULTIRUN itself
    for ov in parsed:
        if ov.is_sweep_override() and not multirun:
            import shlex

            swept = [o for o in overrides if not o.startswith("hydra.run.dir=")]  # a sweep's is hydra.sweep.dir
            again = shlex.join(["python", "-m", "pnpscale", "-m", *swept])
            raise CommandLineError([f"{ov.input_line}: a list of values is a sweep: add -m ({again})"])
    for ov in parsed:
        if (
            ov.is_sweep_override()
            or ov.key_or_group == "sweeps"
            or (ov.key_or_group == "cluster" and str(ov.value()) != "local")
        ):
            check_sweep_files(parsed)
            return

    cfg = compose_config(overrides)
    refused, _ = mode_key_problems([("", cfg, overrides)])  # a key this point's mode would silently ignore
    if refused:
        raise CommandLineError(list(refused))
    # the folder Hydra will write: checked now (resume rule), before Hydra writes its .hydra/ into it
    run_dir = next(
        (str(ov.value()) for ov in parsed if ov.key_or_group == "hydra.run.dir" and "${" not in str(ov.value())),
        None,
    )
    if run_dir is not None:
        check_folder_free("hydra.run.dir", Path(run_dir))
    folder = Path(run_dir) if run_dir else Path(str(cfg.output.root)) / "__not_created__"
    # the value rules first, without torch (resolve_point asks torch for the CUDA devices: 10-20 s under
    # load): a refusal in under 2 s where scale=auto needs no device count (no GPU here, or a scale given)
    if cuda_surely_absent():
        validate(cfg, cuda_available=False)
    elif str(cfg.scale) != "auto":
        validate(cfg, cuda_available=None)
    resolve_point(cfg, folder)

    check_room(Path(run_dir) if run_dir else Path(str(cfg.output.root)))  # before Hydra writes into it
    for ov in parsed:  # accepted (scripts give both), but a single run writes to hydra.run.dir: said, not silent
        if ov.key_or_group in ("hydra.sweep.dir", "hydra.sweep.subdir"):
            where = run_dir if run_dir is not None else "its default, under output.root"
            print(f"pnpscale: note: {ov.input_line} applies to sweeps (-m) only: this single run writes to "
                  f"hydra.run.dir ({where})", file=sys.stderr)  # fmt: skip


def check_sweep_files(parsed: Sequence[Any]) -> None:
    """A sweep that reads a user's own config folder (``hydra.searchpath=[file://...]``): its shared part (the
    overrides that are not swept) is composed now, so that a key one of that folder's YAML files sets and the
    schema does not have (a key moved by the plugins, a top-level ``blur_sigma``) is one line naming the key
    and its new place (:func:`file_key_error`, exit 2) instead of Hydra's multi-line composition error. A
    swept option (``problem=2d,old``) is composed point by point by the launcher
    (:func:`hydra_plugins.pnpscale_plugins.launcher.validate_points`), with the same line.

    Nothing is composed without such a folder: pnpscale's own config files are checked by its tests.

    Raises:
        InputError: see :func:`file_key_error`; any other composition error is left to Hydra.
    """
    if not search_dirs(parsed):
        return
    shared = [str(ov.input_line) for ov in parsed if not ov.is_sweep_override() and ov.input_line]
    try:
        compose_config(shared)
    except InputError:
        raise
    except Exception:  # noqa: BLE001 - not a key of a config file: Hydra composes again and says it
        return


def check_folder_free(key: str, folder: Path) -> None:
    """A run or sweep folder another live process holds (its lock) is refused before Hydra writes
    anything into it (its ``.hydra/``, ``__main__.log``, ``multirun.yaml``).

    Raises:
        ConfigError: naming ``key``, the folder and its holder (exit 2).
    """

    busy = in_use(folder)
    if busy is not None:
        who = busy.holder.text() if busy.holder is not None else "another process (not yet recorded)"
        raise ConfigError(key, str(folder), f"is in use by {who}: wait for it to end, or use another folder")


def _show(ov: Any) -> str:
    try:
        return ov.get_value_element_as_str()
    except Exception:  # noqa: BLE001
        return "?"


def resume_command(
    task_overrides: Sequence[str], hydra_overrides: Sequence[str], folder: Path | str, key: str = "hydra.sweep.dir"
) -> str:
    """The command that runs a sweep (``key="hydra.sweep.dir"``) or a single run (``"hydra.run.dir"``)
    again into ``folder``: complete points are skipped (``resume=true``, the default).

    >>> resume_command(["gpus=1,2,4,8", "cluster=slurm", "resume=true"], ["hydra.mode=MULTIRUN"], "/o/2026")
    'python -m pnpscale -m gpus=1,2,4,8 cluster=slurm hydra.sweep.dir=/o/2026'
    >>> resume_command(["gpus=2"], [], "/o/r", key="hydra.run.dir")
    'python -m pnpscale gpus=2 hydra.run.dir=/o/r'
    """
    import shlex

    keep = [o for o in task_overrides if not o.startswith("resume=")]
    keep += [o for o in hydra_overrides if not o.startswith(("hydra.mode=", f"{key}="))]
    multirun = ["-m"] if key == "hydra.sweep.dir" else []
    return shlex.join(["python", "-m", "pnpscale", *multirun, *keep, f"{key}={hydra_value(str(folder))}"])


#: A value Hydra's override grammar reads as the same string unquoted (``ID``/``UNQUOTED_CHAR`` of
#: ``OverrideLexer.g4``, without ``\\``, ``$`` and the characters it reads as a number, bool or null).
_HYDRA_PLAIN = re.compile(r"[A-Za-z_/.][A-Za-z0-9_/.\-+:@%]*")  # a leading sign or digit, and ~, are quoted
_HYDRA_WORDS = {"true", "false", "null", "nan", "inf", "-inf", "+inf"}


def hydra_value(text: str) -> str:
    """``text`` as a value of a Hydra override that reads back as exactly ``text`` (a folder name with
    ``|<>&``, backticks, quotes, ``,``, ``=``, spaces, ``${...}`` or backslashes): as it is when Hydra's
    grammar reads it unquoted as that string, else single-quoted with Hydra's escapes (``\\'`` for a
    quote, ``\\${`` for an interpolation's start, the backslashes before either or before the closing
    quote doubled). The shell's own quoting comes on top (:func:`resume_command`).

    >>> hydra_value("/o/2026-01-01_10-00-00"), hydra_value("/o/a|b<c>&`d`"), hydra_value("/o/it's ${x}")
    ('/o/2026-01-01_10-00-00', "'/o/a|b<c>&`d`'", "'/o/it\\\\'s \\\\${x}'")
    """
    if _HYDRA_PLAIN.fullmatch(text) and text.lower() not in _HYDRA_WORDS:
        return text
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == "\\":
            j += 1
        slashes = j - i
        nxt = text[j] if j < len(text) else None
        special = nxt == "'" or nxt is None or text.startswith("${", j)
        out.append("\\" * (2 * slashes if special else slashes))
        if nxt == "'":
            out.append("\\'")
            j += 1
        elif nxt == "$" and text.startswith("${", j):
            out.append("\\$")
            j += 1
        elif nxt is not None:
            out.append(nxt)
            j += 1
        i = j
    return "'" + "".join(out) + "'"
