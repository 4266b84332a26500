"""Dependencies are ranges, not pins, and the code stays off torch APIs its lowest supported version lacks.

pyproject.toml states every dependency as a range (``>=lowest,<next``); docs/install.md says which versions ran
the suite where. The running torch must lie inside the stated range. The code's torch API surface (every
``torch.*`` name pnpscale imports or reaches by attribute, found by reading its source) is compared with
:data:`TORCH_APIS`, the names checked to exist in torch 2.11 (the range's lowest): a name outside it fails
here until someone checks it exists in 2.11 (``python -c "import torch; torch.<name>"`` in a 2.11
environment, or its docs' "added in") and adds it.
"""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOWEST_TORCH = Version("2.11")

#: Every torch name pnpscale uses, each present in torch 2.11 (all predate it: the newest,
#: ``torch.distributed.elastic.multiprocessing.DefaultLogsSpecs``, came with torch 2.2).
TORCH_APIS = frozenset({
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.distributed_c10d._world",  # the _World registry (torch 1.13); pg_names: group -> name
    "torch.distributed.distributed_c10d._world.pg_names",
    "torch.distributed.distributed_c10d._world.pg_names.items",
    "torch.Generator",
    "torch.Tensor",
    "torch._C",
    "torch.__version__",
    "torch.arange",
    "torch.autograd",
    "torch.autograd.Function",
    "torch.autograd.function.once_differentiable",
    "torch.bool",
    "torch.cat",
    "torch.contiguous_format",
    "torch.cuda",
    "torch.cuda.Event",
    "torch.cuda._sleep",
    "torch.cuda.current_device",
    "torch.cuda.device",
    "torch.cuda.device_count",
    "torch.cuda.get_device_name",
    "torch.cuda.get_device_properties",
    "torch.cuda.is_available",
    "torch.cuda.max_memory_allocated",
    "torch.cuda.max_memory_reserved",
    "torch.cuda.nccl",
    "torch.cuda.nccl.version",
    "torch.cuda.reset_peak_memory_stats",
    "torch.cuda.set_device",
    "torch.cuda.synchronize",
    "torch.device",
    "torch.distributed.ReduceOp",
    "torch.distributed.ReduceOp.SUM",
    "torch.distributed.all_gather_into_tensor",
    "torch.distributed.all_reduce",
    "torch.distributed.all_to_all_single",
    "torch.distributed.barrier",
    "torch.distributed.destroy_process_group",
    "torch.distributed.elastic.multiprocessing.DefaultLogsSpecs",
    "torch.distributed.elastic.multiprocessing.Std",
    "torch.distributed.elastic.multiprocessing.Std.ALL",
    "torch.distributed.elastic.multiprocessing.Std.OUT",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    "torch.distributed.elastic.multiprocessing.errors.record",
    "torch.distributed.gather_object",
    "torch.distributed.get_backend",
    "torch.distributed.group",
    "torch.distributed.group.WORLD",
    "torch.distributed.get_rank",
    "torch.distributed.get_world_size",
    "torch.distributed.init_process_group",
    "torch.distributed.is_available",
    "torch.distributed.is_initialized",
    "torch.distributed.launcher.api.LaunchConfig",
    "torch.distributed.launcher.api.elastic_launch",
    "torch.distributed.reduce_scatter_tensor",
    "torch.distributed.send", "torch.distributed.recv",  # point-to-point since torch 1.0
    # the module-global that profile._start_trace calls (its binding takes scopes since torch 1.13)
    "torch.autograd.profiler", "torch.autograd.profiler._enable_profiler",
    "torch.distributed.rendezvous",
    "torch.dtype",
    "torch.empty",
    "torch.empty_like",
    "torch.exp",
    "torch.float32",
    "torch.full",
    "torch.int32",
    "torch.is_grad_enabled",
    "torch.linspace",
    "torch.log",
    "torch.manual_seed",
    "torch.mean",
    "torch.meshgrid",
    "torch.nn",
    "torch.nn.Module",
    "torch.nn.Parameter",
    "torch.nn.functional",
    "torch.nn.functional.pad",
    "torch.no_grad",
    "torch.nonzero",
    "torch.optim",
    "torch.optim.Adam",
    "torch.profiler.ProfilerActivity",
    "torch.profiler.ProfilerActivity.CPU",
    "torch.profiler.ProfilerActivity.CUDA",
    "torch.profiler.profile",
    "torch.profiler.record_function",
    "torch.rand",
    "torch.randn",
    "torch.random",
    "torch.random.fork_rng",
    "torch.roll",
    "torch.save",
    "torch.searchsorted",
    "torch.set_flush_denormal",
    "torch.set_num_threads",
    "torch.stack",
    "torch.tensor",
    "torch.unique",
    "torch.utils.checkpoint.checkpoint",
    "torch.version",
    "torch.version.cuda",
    "torch.where",
    "torch.zeros",
    "torch.zeros_like",
})  # fmt: skip


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    listed = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


def torch_names_used(source: str) -> set[str]:
    r"""Dotted ``torch.*`` names a module's source imports or reaches by attribute (aliases followed).

    >>> sorted(torch_names_used("import torch.distributed as dist\nfrom torch import nn\ndist.all_reduce(x)"))
    ['torch.distributed', 'torch.distributed.all_reduce', 'torch.nn']
    """
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
                    names.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                names.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in alias:
                names.add(".".join([alias[base.id], *reversed(chain)]))
    return names


def test_no_dependency_is_pinned_to_one_version():
    for extra in (None, "test", "docs"):
        for req in _requirements(extra):
            ops = {s.operator for s in req.specifier}
            assert "==" not in ops and "===" not in ops, f"{req}: a pin (a range, lowest..highest, is wanted)"
    for req in _requirements():
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "<" in ops, f"{req}: the range needs its lowest (>=) and a bound above (<)"


def test_torch_range_reaches_down_to_2_11_and_holds_the_running_torch():
    reqs = {r.name: r for r in _requirements()}
    torch_range = reqs["torch"].specifier
    assert LOWEST_TORCH in torch_range and not torch_range.contains(Version("2.10.99")), torch_range
    for name in ("torch", "torchvision", "deepinv", "hydra-core", "pandas"):
        running = Version(version(name).split("+")[0])
        assert running in reqs[name].specifier, f"{name} {running} outside the stated {reqs[name].specifier}"


def test_the_code_uses_no_torch_api_outside_the_checked_list():
    used: dict[str, str] = {}
    for path in sorted((ROOT / "pnpscale").rglob("*.py")):
        for name in torch_names_used(path.read_text()):
            used.setdefault(name, str(path.relative_to(ROOT)))
    new = {n: where for n, where in used.items() if n not in TORCH_APIS and not n.startswith("torch._C.")}
    assert not new, (
        f"torch names not yet checked against torch {LOWEST_TORCH} (the lowest in pyproject.toml): {new}; check "
        "each exists there, then add it to TORCH_APIS"
    )
    assert len(used) > 50  # the scan reads the code (not an empty walk)


@pytest.mark.parametrize("name", ["torch", "torchvision"])
def test_the_installed_version_is_the_highest_the_range_names(name):
    """The suite runs at the top of the range (CI installs the newest pip allows): a top bound left behind after
    an upgrade would leave the newest version untested and unstated."""
    spec = {r.name: r for r in _requirements()}[name].specifier
    running = Version(version(name).split("+")[0])
    (upper,) = [Version(s.version) for s in spec if s.operator == "<"]
    assert running < upper and (running.major, running.minor + 1) >= (upper.major, upper.minor), (running, spec)
