"""The house: no import cycles, one owner of file names, registries that extend without edits, old records load."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.core import layout
from tests.helpers import ROOT, TINY_2D, read_run, run_cli, run_dirs

PKG = ROOT / "pnpscale"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every pnpscale module ``name`` imports, at module level, inside functions or ``TYPE_CHECKING``
    blocks alike, resolved to known module names (``from pnpscale import columns`` is ``pnpscale.columns``,
    not the package root)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = subs if any(t in known for t in subs) else [base]
        for t in targets:
            while t and t not in known:  # pnpscale.analysis.metrics.decompose -> pnpscale.analysis.metrics
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


#: The floors of the house, lowest first: a module imports only modules of its own floor or below.
#: Floor 0 is the ground floor (pnpscale.core, with layout, and the schema module columns).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("pnpscale.core", "pnpscale.columns"),
    ("pnpscale.analysis",),
    ("pnpscale.rank",),
    ("pnpscale.cluster",),
    ("pnpscale.results",),
    ("pnpscale.sweep",),
    ("pnpscale.validation",),
)
#: The one deliberate exception: the package root's facade ``pnpscale.load`` (a notebook's entry point)
#: imports the results stage inside the function; nothing imports the root itself.
FACADE = "pnpscale"


def _floor(module: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(FLOORS)  # the commands: pnpscale.__main__, analyze, report, validate, project


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, set(mods)) for m, p in mods.items()}


def test_no_import_cycle_through_any_import():
    """No cycle, counting imports inside functions too; the facade is left out (nothing imports it)."""
    graph = _graph()
    assert not [m for m, deps in graph.items() if FACADE in deps], "a module imports the package root"
    graph = {m: deps for m, deps in graph.items() if m != FACADE}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_import_runs_down_the_floors():
    """Each import, wherever it sits in a module, goes to the module's own floor or one below (FLOORS)."""
    graph = _graph()
    up = [
        f"{m} (floor {_floor(m)}) imports {n} (floor {_floor(n)})"
        for m, deps in sorted(graph.items())
        if m != FACADE
        for n in sorted(deps)
        if _floor(n) > _floor(m)
    ]
    assert not up, "imports that run back up:\n" + "\n".join(up)
    ground = [f"{m} imports {n}" for m, deps in graph.items() if _floor(m) == 0 for n in deps if _floor(n) > 0]
    assert not ground, ground


def test_the_subpackage_indexes_name_only_modules_that_exist():
    """Each subpackage's docstring (its index) may name its modules; every ``pnpscale.x.y`` it names exists
    (checked this way round, so that a new module never fails a test for lack of a line in an index)."""
    known = set(_modules())
    stale = []
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for ref in re.findall(r":mod:`~?(pnpscale[\w.]*)`", doc):
            if ref not in known:
                stale.append(f"{init.relative_to(ROOT)}: {ref}")
    assert not stale, "an index names a module that does not exist:\n" + "\n".join(stale)


def _package_files() -> list[Path]:
    return sorted([*PKG.rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])


def _inside_function(tree: ast.AST) -> set[int]:
    """ids of the import nodes that lie inside a function body."""
    inner: set[int] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                inner.add(id(child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return inner


def _own(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "pnpscale"
    return any(a.name.split(".")[0] == "pnpscale" for a in node.names)


#: At most this many imports of another module's private (``_name``) names, each a deliberate helper.
MAX_PRIVATE_IMPORTS = 5
#: At most this many own-package imports inside functions, each a documented cycle break or start-up deferral.
MAX_INNER_IMPORTS = 20


def test_modules_talk_through_public_names():
    """``from pnpscale.x import _y`` across modules: at most MAX_PRIVATE_IMPORTS (issue: 58 before step 3)."""
    found = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and _own(node):
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert len(found) <= MAX_PRIVATE_IMPORTS, "private names imported across modules:\n" + "\n".join(found)


def test_own_imports_inside_functions_are_few_and_each_says_why():
    """Own-package imports live at module level, except at most MAX_INNER_IMPORTS deferrals, each with a
    ``# deferred: <reason>`` comment on its line (a heavy import kept off the start-up path, a cycle broken)."""
    inner, silent = [], []
    for path in _package_files():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        ids = _inside_function(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) in ids and _own(node):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                inner.append(where)
                text = " ".join(lines[node.lineno - 1 : node.end_lineno])
                if "# deferred:" not in text:
                    silent.append(where)
    assert len(inner) <= MAX_INNER_IMPORTS, f"{len(inner)} own imports inside functions:\n" + "\n".join(inner)
    assert not silent, "imports inside functions without a '# deferred: <reason>' comment:\n" + "\n".join(silent)


def test_no_prefix_family_of_four_modules_in_one_folder():
    """A family of 4+ modules sharing a name prefix (``trace_*``, ``section_*``) is a subpackage in disguise."""
    families = []
    for folder in {p.parent for p in PKG.rglob("*.py")}:
        stems = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        for prefix in {s.split("_")[0] for s in stems if "_" in s}:
            members = [s for s in stems if s == prefix or s.startswith(prefix + "_") or s == prefix + "s"]
            if len(members) >= 4:
                families.append(f"{folder.relative_to(ROOT)}: {sorted(members)}")
    assert not families, "prefix families (make each a subpackage):\n" + "\n".join(families)


def test_no_test_file_is_named_after_a_batch():
    """Test files are named after what they test, not the batch of work that wrote them."""
    batch = re.compile(r"(turn|batch|round|set|sprint|issue)[-_]?\d+")
    named = [p.name for p in (ROOT / "tests").rglob("test_*.py") if batch.search(p.stem)]
    named += [p.name for p in (ROOT / "tests" / "data").iterdir() if p.is_dir() and batch.search(p.name)]
    assert not named, f"named after a batch: {named}"


def test_subprocesses_run_this_checkout():
    """A ``python`` started by a test imports this checkout's pnpscale (tests/conftest.py sets PYTHONPATH)."""
    proc = subprocess.run([sys.executable, "-c", "import pnpscale; print(pnpscale.__file__)"],
                          capture_output=True, text=True, timeout=60, cwd="/")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == (PKG / "__init__.py").resolve()


def test_every_module_imports_in_a_fresh_interpreter():
    names = [m for m in _modules() if not m.endswith("__main__")]
    code = (
        "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\nprint('ok', len(sys.argv) - 1)"
    )
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"ok {len(names)}"


#: File names a run writes that are not pnpscale's to choose (torch elastic's own per-rank files),
#: and the report's chart names (owned by the CHARTS registry next to the functions that draw them).
_FOREIGN = {
    ("pnpscale/cluster/local.py", "error.json"),
    ("pnpscale/cluster/local.py", "stderr.log"),
}
_FILE_NAME = re.compile(r"^[\w{}\-][\w.{}\-]*\.(parquet|json|log|pt|out|err|yaml|md|png|csv|txt|html)$|^rank\{")


def test_layout_owns_every_file_name_a_run_writes():
    """Only pnpscale.core.layout spells a run-folder file name (``*.parquet``, ``run.json``, ``rank{r}...``)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "pnpscale/core/layout.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if _FILE_NAME.match(node.value) and (rel, node.value) not in _FOREIGN:
                    offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
                if re.match(r"^rank$", text.split("{")[0]) and re.search(r"\.(log|json|out|err)", text):
                    offenders.append(f"{rel}:{node.lineno}: f-string {text!r}")
    assert not offenders, "file names outside pnpscale.core.layout:\n" + "\n".join(offenders)


def test_nothing_in_the_package_points_outside_the_repository():
    hits = []
    configs = [*(ROOT / "conf").rglob("*.yaml"), *(ROOT / "sweeps").glob("*.yaml")]
    assert len(configs) > 10, "the config tree and the stored sweeps were not found at the top level"
    for path in [*PKG.rglob("*.py"), *configs, ROOT / "README.md"]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "../shared" in line or "seed page" in line:
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_a_record_of_schema_1_loads_and_is_upgraded():
    """A run folder written before run.json was typed (no schema_version, totals under per-iteration names)."""
    import pnpscale
    from pnpscale.core.record import SCHEMA_VERSION, read_record

    sweep = ROOT / "tests" / "data" / "run_v1"
    run_dir = sweep / "problem=2d" / "mode=inference" / "gpus=2"
    raw = json.loads((run_dir / layout.RUN_JSON).read_text())
    assert "schema_version" not in raw and "compute_s" in raw["metrics"]["sections"]["gradient"]
    rec = read_record(run_dir)
    assert rec.schema_version == SCHEMA_VERSION and rec.status == "complete" and rec.gpus == 2
    grad = rec.metrics["sections"]["gradient"]
    assert grad["compute_total_s"] == raw["metrics"]["sections"]["gradient"]["compute_s"]
    assert "compute_s" not in grad and grad["iterations"] == 1
    # schema 4: the plugins' keys moved into their own nodes, the values kept as recorded
    assert raw["spec"]["blur_sigma"] == 1.0 and raw["spec"]["lr"] == 0.0001
    assert rec.spec["params"]["blur_sigma"] == 1.0 and "blur_sigma" not in rec.spec
    assert rec.spec["mode_params"] == {"lr": 0.0001, "train_stepsize": False} and "lr" not in rec.spec
    table = pnpscale.load(str(sweep))
    row = table[(table[K.SECTION] == "gradient")].iloc[0]
    assert row["status"] == "complete" and row["gpus"] == 2
    sections = pd.read_parquet(run_dir / layout.SECTIONS)
    measured = sections[(sections[K.SECTION] == "gradient") & ~sections[K.WARMUP]]
    assert row[K.COMPUTE_S] == pytest.approx(measured[K.COMPUTE_S].mean())


def test_a_record_roundtrips_and_keeps_unknown_keys(tmp_path):
    from pnpscale.core.record import SCHEMA_VERSION, RecordError, RunRecord, read_record, update_record, write_record

    write_record(tmp_path, RunRecord(status="running", problem="2d", mode="inference", gpus=2).set(anomalies=[]))
    update_record(tmp_path, slurm={"job_id": "7"}, future_block={"x": 1})
    rec = read_record(tmp_path)
    assert rec.slurm == {"job_id": "7"} and rec.extra == {"anomalies": [], "future_block": {"x": 1}}
    assert json.loads((tmp_path / layout.RUN_JSON).read_text())["future_block"] == {"x": 1}
    (tmp_path / layout.RUN_JSON).write_text("{garbage")
    with pytest.raises(RecordError, match=r"run\.json: invalid JSON"):
        read_record(tmp_path)
    (tmp_path / layout.RUN_JSON).write_text(json.dumps({"status": "complete", "schema_version": 99}))
    with pytest.raises(RecordError, match=f"schema_version 99: this pnpscale reads 1..{SCHEMA_VERSION}"):
        read_record(tmp_path)


def test_cluster_backends_come_from_the_registry():
    """Every option of the config group ``cluster`` names a Cluster subclass; the task knows only the interface."""
    from pnpscale.cluster import cluster_backend
    from pnpscale.cluster.base import Cluster
    from pnpscale.core.config import ConfigError
    from pnpscale.sweep.cli import compose_config, group_options

    names = group_options("cluster")
    assert names, "no cluster backend found in conf/cluster/"
    for name in names:
        cfg = compose_config([f"cluster={name}"])
        backend = cluster_backend(cfg.cluster)
        assert isinstance(backend, Cluster) and backend.name == name
    with pytest.raises(ConfigError, match="cluster.impl=nowhere:Pbs: cannot import nowhere"):
        cluster_backend({"name": "pbs", "impl": "nowhere:Pbs"})
    with pytest.raises(ConfigError, match="not a subclass of pnpscale.cluster.base.Cluster"):
        cluster_backend({"name": "x", "impl": "collections:OrderedDict"})
    task = (PKG / "sweep" / "task.py").read_text()
    assert "slurm" not in task.lower(), "the Hydra task must know only the Cluster interface"


@pytest.mark.slow
def test_a_problem_added_through_the_registry_runs_end_to_end(tmp_path):
    """tests/toy_problem.py + tests/data/conf/problem/toy.yaml, nothing else: 2 CPU ranks, complete run."""
    conf = ROOT / "tests" / "data" / "conf"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = run_cli(
        "problem=toy", "gpus=2", "iterations=2", "warmup=1", f"hydra.searchpath=[file://{conf}]",
        root=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    run = read_run(run_dir)
    assert run["status"] == "complete" and run["problem"] == "toy" and run["spec"]["linestyle"] == ":"
    assert run["assignment"]["operators_per_rank"] == [2, 1]  # 3 operators round-robin on 2 ranks
    colls = pd.read_parquet(run_dir / layout.COLLECTIVES)
    main = colls[colls[K.MAIN]]
    assert set(main[K.PAYLOAD_BYTES]) == {1 * 32 * 32 * 4}  # one channel, 32x32, float32
    from pnpscale.sweep.cli import CommandLineError, check_overrides, group_options

    # refusals in-process: the command line's check (its wiring to one stderr line and exit 2: tests/test_config.py)
    allowed = ", ".join(group_options("problem"))  # the registry: the group's options (no searchpath here)
    with pytest.raises(CommandLineError) as bad:
        check_overrides(["problem=nope"])
    assert bad.value.problems == [f"problem=nope: allowed values: {allowed}"]
    assert "toy" in group_options("problem", [conf])  # with the searchpath, the toy problem is an option too


@pytest.mark.slow
def test_a_cluster_backend_added_through_the_registry_runs_and_checks_its_own_keys(tmp_path):
    """tests/toy_cluster.py + tests/data/conf/cluster/toy.yaml, nothing else: its key is known, checked, run."""
    conf = ROOT / "tests" / "data" / "conf"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    search = f"hydra.searchpath=[file://{conf}]"
    proc = run_cli("cluster=toy", "cluster.note=hello", "gpus=1", *TINY_2D, search, root=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert read_run(run_dir)["status"] == "complete"
    from pnpscale.sweep.cli import CommandLineError, check_overrides

    # refusals in-process: the command line's check (its wiring to one stderr line and exit 2: tests/test_config.py)
    with pytest.raises(CommandLineError) as bad:
        check_overrides(["cluster=toy", "cluster.note=", "gpus=1", *TINY_2D, search])
    assert any("cluster.note=: must be a non-empty string" in line for line in bad.value.problems), bad.value.problems
    with pytest.raises(CommandLineError) as other:
        check_overrides(["cluster=toy", "cluster.partition=gpu", search])
    said = "cluster.partition=gpu: a key of cluster=slurm, not of cluster=toy"
    assert any(said in line for line in other.value.problems), other.value.problems


def test_tiny_2d_overrides_still_compose():
    from pnpscale.sweep.cli import compose_config
    from pnpscale.sweep.point import resolve_point

    cfg = compose_config(["gpus=2", *TINY_2D])
    point = resolve_point(cfg, Path("/nonexistent/run"), cuda_devices=0)
    assert point.spec.dims == 2 and point.spec.sections == ("gradient", "denoiser")
    assert point.label == "problem=2d mode=inference num_operators=4 gpus=2" and point.done is None
    # one naming rule: a variant key set explicitly names the point in logs as in its folder
    other = resolve_point(compose_config(["gpus=2", *TINY_2D, "problem.num_operators=2"]), Path("/x"), cuda_devices=0)
    assert other.label == "problem=2d mode=inference num_operators=2 gpus=2"
    folder = layout.point_subdir("2d", "inference", 2, other.variant)
    assert folder == "problem=2d/mode=inference/num_operators=2/gpus=2"
