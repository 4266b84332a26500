"""make_profiler's default leaves out the autograd node ranges (RecordScope.BACKWARD_FUNCTION) and keeps
what the decomposition reads: operators, the engine's evaluate_function ranges, record_function sections."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import record_function

from pnpscale.analysis.events import Kind
from pnpscale.analysis.overlap import communicating, compute_spans
from pnpscale.rank.profiling import make_profiler, profiler_events

EVALUATE = "autograd::engine::evaluate_function: "


def _session(autograd_ranges: bool) -> Counter[str]:
    x = torch.randn(8, 8, requires_grad=True)
    with make_profiler(cuda=False, autograd_ranges=autograd_ranges) as prof:
        with record_function("gradient"):
            (x @ x).sin().sum().backward()
    return Counter(e.name for e in profiler_events(prof) if e.kind in (Kind.OP, Kind.CPU))


@pytest.mark.slow  # the first profiler session of a process starts Kineto (seconds)
def test_default_drops_only_the_node_ranges() -> None:
    default, full = _session(False), _session(True)
    nodes = {"MmBackward0", "SinBackward0", "SumBackward0", "torch::autograd::AccumulateGrad"}
    assert nodes <= set(full) and not nodes & set(default)
    assert {EVALUATE + n for n in nodes} <= set(default)  # the engine's ranges around them stay
    assert default["gradient"] == 1 and default["aten::mm"] == full["aten::mm"] >= 3  # forward + 2 in backward
    # the second session's AccumulateGrad adds into an existing .grad: one aten::add_ more; nothing else differs
    assert full - default - Counter(nodes) - Counter({"aten::add_": 1}) == Counter()


def test_node_range_inside_its_evaluate_function_changes_no_compute_span() -> None:
    """The node range lies inside its evaluate_function range and encloses the same operators (ns)."""
    ops = [(100, 200, EVALUATE + "MmBackward0"), (110, 190, "aten::mm"), (120, 180, "aten::addmm")]
    node = (105, 195, "MmBackward0")
    for extra in ([], [(150, 160, "c10d::allreduce_")]):  # also when the node issues a collective
        without = ops + extra
        with_node = without + [node]
        spans = [compute_spans([(s, e, f) for (s, e, _), f in zip(o, communicating(o), strict=True)])
                 for o in (without, with_node)]  # fmt: skip
        assert spans[0] == spans[1], extra
