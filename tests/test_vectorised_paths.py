"""The vectorised forms of the analysis's per-row loops equal the loops they replaced, on random input.

Each reference below is the loop as it was written before (the plain definition of the quantity); the product
computes the same with pandas / bisection. Equality is exact (the same float operations, in the same order).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from pnpscale import columns as K
from pnpscale.analysis.events import Event, Kind
from pnpscale.analysis.overlap import rank_blocked
from pnpscale.analysis.section.busy import Busy
from pnpscale.analysis.waits import _entry_skew


def entry_skew_loop(r: pd.DataFrame) -> pd.Series:
    """The anchor walk of :func:`pnpscale.analysis.waits._entry_skew`, row by row (the reference)."""
    g = pd.Series(np.nan, index=r.index)
    for _, grp in r.sort_values("_s", kind="stable").groupby([K.ITERATION, K.RANK], sort=False):
        anchor = grp["_s"].iloc[0]
        for idx, s, last in zip(grp.index, grp["_s"], grp["_last"], strict=True):
            g[idx] = s - anchor
            if pd.notna(last):
                anchor = max(anchor, last)
    return g


_times = st.one_of(st.none(), st.floats(0, 10, allow_nan=False).map(lambda x: round(x, 3)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), _times, _times), min_size=1, max_size=30))
def test_entry_skew_equals_the_anchor_walk(rows):
    r = pd.DataFrame(
        {
            K.ITERATION: [it for it, _, _, _ in rows],
            K.RANK: [rk for _, rk, _, _ in rows],
            "_s": [np.nan if s is None else s for _, _, s, _ in rows],
            "_last": [np.nan if x is None else x for _, _, _, x in rows],
        },
        index=pd.RangeIndex(len(rows)) * 3 + 7,  # an index that is not 0..n-1
    )
    pd.testing.assert_series_equal(_entry_skew(r), entry_skew_loop(r), check_names=False)


_span = st.tuples(st.integers(0, 1000), st.integers(1, 200)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=100, deadline=None)
@given(st.lists(_span, max_size=40), st.lists(_span, min_size=1, max_size=6), st.one_of(st.none(), _span))
def test_gpu_busy_near_the_kernels_gives_the_blocked_time_of_all_of_it(gpu, kernels, window):
    busy = Busy([], [], [Event(f"k{i}", Kind.GPU, lo, hi) for i, (lo, hi) in enumerate(gpu)])
    assert rank_blocked(kernels, busy.gpu_near(kernels), window) == rank_blocked(kernels, busy.gpu, window)
    assert busy.gpu_near([]) == []


_number_texts = st.lists(
    st.one_of(
        st.from_regex(rb"\A\d{1,17}\.\d{3}\Z"),  # Kineto's form
        st.from_regex(rb"\A-?\d{0,4}(\.\d{0,5})?([eE][+-]?\d)?\Z"),  # other JSON numbers, and near misses
        st.binary(max_size=6).filter(lambda b: b" " not in b),  # a JSON value's text: no space outside a string
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(_number_texts)
def test_the_kineto_column_check_equals_the_regular_expression(texts):
    """:func:`pnpscale.analysis.trace.scan.kineto_column` (arrays) says what the regex it replaced says, on texts
    without spaces (a ``ts``/``dur`` value's text: a number has none, a string has its quotes)."""
    import re

    from pnpscale.analysis.trace.scan import kineto_column, ns_array

    joined = b" ".join(texts)
    regex = re.fullmatch(rb"(?:\d+\.\d{3} )*\d+\.\d{3}", joined) is not None
    assert kineto_column(joined, len(texts)) is regex
    if regex:
        import msgspec

        assert ns_array([msgspec.Raw(t) for t in texts]).tolist() == [min(int(t.replace(b".", b"")), 2**63 - 1)
                                                                     for t in texts]  # fmt: skip
