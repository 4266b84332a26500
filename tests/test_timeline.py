"""The per-rank timeline: slices at measured times that add up to each rank's section time."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis import timeline_slices as T
from pnpscale.analysis.metrics import decompose
from pnpscale.analysis.tables import table_writers
from pnpscale.core import layout


def random_run(world: int = 4, iterations: int = 3, seed: int = 0, n_coll: int = 3):
    """Ranks and collectives of a run with known times: rank r's clock starts ``0.01 r`` s late;
    collectives are sequential, ranks leave each one together (same exit on a common clock)."""
    rng = np.random.default_rng(seed)
    ranks, colls = [], []
    t = 0.0
    for it in range(iterations):
        for sec in ("gradient", "denoiser"):
            arrivals = t + rng.uniform(0.01, 0.05, world)  # first collective's arrival per rank
            starts = np.full(world, t) + rng.uniform(0.0, 0.005, world)
            rows_c = []
            for seq in range(n_coll):
                exit_ = arrivals.max() + rng.uniform(0.001, 0.004)
                for r in range(world):
                    rows_c.append((r, seq, arrivals[r], exit_ - arrivals[r]))
                arrivals = exit_ + rng.uniform(0.001, 0.02, world)
            ends = arrivals + rng.uniform(0.0, 0.01, world)
            for r in range(world):
                clock = 0.01 * r  # rank r's origin
                ranks.append({K.RANK: r, K.ITERATION: it, K.SECTION: sec, K.WARMUP: it == 0,
                              K.START_S: starts[r] - clock, K.SECTION_S: ends[r] - starts[r]})  # fmt: skip
            for r, seq, a, d in rows_c:
                colls.append({K.RANK: r, K.ITERATION: it, K.SECTION: sec, K.SEQ: seq, K.COLLECTIVE: "all_reduce",
                              K.START_S: a - 0.01 * r, K.DURATION_S: d, K.PAYLOAD_BYTES: 4096})  # fmt: skip
            t = ends.max() + 0.001
    ranks_df = pd.DataFrame(ranks)
    colls_df = pd.DataFrame(colls)
    ranks_df[K.COMM_S] = ranks_df.merge(
        colls_df.groupby([K.RANK, K.ITERATION, K.SECTION])[K.DURATION_S].sum().reset_index(),
        on=[K.RANK, K.ITERATION, K.SECTION],
    )[K.DURATION_S]
    return ranks_df, colls_df


def test_slices_add_up_to_each_ranks_section_time_and_to_the_decomposition():
    ranks, colls = random_run()
    s = T.slices(ranks, colls)
    assert list(s.columns) == list(K.TIMELINE_COLUMNS) and (s[K.DURATION_S] > 0).all()
    tot = T.section_totals(s).merge(ranks, on=[K.RANK, K.ITERATION, K.SECTION], suffixes=("", "_rank"))
    assert len(tot) == len(ranks)
    assert (tot[K.SECTION_S] - tot[K.SECTION_S + "_rank"]).abs().max() < 2e-9  # integer ns boundaries
    # averaged over ranks, each kind is the section's POP compute, transfer and wait
    sec = decompose(ranks, colls).set_index([K.ITERATION, K.SECTION])
    mean = tot.groupby([K.ITERATION, K.SECTION])[[T.COMPUTE, T.TRANSFER, T.WAIT]].mean()
    for kind, col in ((T.COMPUTE, K.COMPUTE_S), (T.TRANSFER, K.TRANSFER_S), (T.WAIT, K.WAIT_S)):
        assert np.allclose(mean[kind], sec.loc[mean.index, col], atol=1e-8), kind
    # slices of a rank are contiguous and in time order: wait right before transfer, both inside the collective
    for _, g in s.groupby([K.RANK, K.ITERATION, K.SECTION]):
        ends = (g[K.START_S] + g[K.DURATION_S]).to_numpy()[:-1]
        assert np.allclose(ends, g[K.START_S].to_numpy()[1:], atol=1e-9)
    w = s[s[K.KIND] == T.WAIT].reset_index()
    nxt = s.loc[w["index"] + 1]
    assert (nxt[K.KIND] == T.TRANSFER).all() and (nxt[K.SEQ].to_numpy() == w[K.SEQ].to_numpy()).all()


def test_clock_offsets_recover_each_ranks_origin():
    ranks, colls = random_run()
    off = T.clock_offsets(colls)
    assert off == pytest.approx({r: 0.01 * r for r in range(4)}, abs=1e-9)
    # on the common clock every rank's transfer of a collective ends at the same instant
    s = T.slices(ranks, colls)
    tr = s[s[K.KIND] == T.TRANSFER]
    end = tr[K.START_S] + tr[K.DURATION_S] + tr[K.RANK].map(off)
    spread = end.groupby([tr[K.ITERATION], tr[K.SECTION], tr[K.SEQ]]).agg(lambda e: e.max() - e.min())
    assert spread.max() < 2e-9  # ns rounding


def test_blocked_spans_place_wait_transfer_and_hidden_and_the_tiling_adds_up():
    """The decomposition's blocked pieces (``blocked_spans_ns``) are wait or transfer, in flight and not blocked is
    hidden (over compute); concurrent collectives are cut to their union, a collective past the end is cut there."""
    ranks = pd.DataFrame({K.RANK: [0, 1], K.ITERATION: 0, K.SECTION: "s", K.WARMUP: False, K.START_S: 0.0,
                          K.SECTION_S: [1.0, 1.0]})  # fmt: skip
    colls = pd.DataFrame({
        K.RANK: [0, 1, 0, 1], K.ITERATION: 0, K.SECTION: "s", K.SEQ: [0, 0, 1, 1], K.COLLECTIVE: "all_reduce",
        # rank 0's seq 0 computes under its first 0.1 s (blocked from 0.1 s on); its seq 1 starts before seq 0 ended
        # and runs past the section's end
        K.START_S: [0.2, 0.4, 0.5, 0.9], K.DURATION_S: [0.4, 0.2, 0.6, 0.2], K.PAYLOAD_BYTES: 8,
        K.BLOCKED_SPANS_NS: ["100000000-400000000", None, None, None],
    })  # fmt: skip
    s = T.slices(ranks, colls)
    r0 = s[s[K.RANK] == 0][[K.KIND, K.START_S, K.DURATION_S]].round(9).values.tolist()
    assert r0 == [
        # seq 0: t_c = 0.2 s, so its blocked time in [0.4, 0.6] is transfer and [0.3, 0.4] wait
        ["compute", 0.0, 0.3], ["wait", 0.3, 0.1], ["transfer", 0.4, 0.2],
        # seq 1 from 0.6 (its first 0.1 s overlapped seq 0's blocked time), to the section's end
        ["wait", 0.6, 0.3], ["transfer", 0.9, 0.1],
        ["hidden", 0.2, 0.1],  # seq 0 in flight, not blocked: over compute
    ]  # fmt: skip
    tot = T.section_totals(s)
    assert tot[K.SECTION_S].tolist() == pytest.approx([1.0, 1.0])
    assert tot[T.HIDDEN].tolist() == pytest.approx([0.1, 0.0])


def test_chrome_trace_is_one_process_per_rank_with_the_documented_args(tmp_path):
    ranks, colls = random_run(world=2, iterations=2)
    writers = table_writers(ranks, colls.assign(**{K.MAIN: True}), decompose(ranks, colls))
    layout.commit_files(tmp_path, writers)
    doc = json.loads((tmp_path / layout.TIMELINE_JSON).read_text())
    ev = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {T.PID_BASE: "rank 0", T.PID_BASE + 1: "rank 1"} and doc["displayTimeUnit"] == "ms"
    assert all(e["pid"] > 0 and e.get("tid", 1) > 0 for e in ev)  # Perfetto's pid / tid 0: the idle process
    xs = [e for e in ev if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0.0
    sections = [e for e in xs if e["cat"] == "section"]
    assert len(sections) == len(ranks)
    comm = [e for e in xs if e["cat"] in (T.WAIT, T.TRANSFER)]
    documented = {"section", "iteration", "warmup", "collective", "seq", "bytes"}
    assert comm and all(documented <= set(e["args"]) for e in comm)
    assert {e["args"]["warmup"] for e in xs} == {True, False}

    # per rank x iteration x section, the slices' durations (us) add up to the section range's
    def key(e):
        return e["pid"], e["args"]["iteration"], e["args"]["section"]

    for sec in sections:
        inner = [e for e in xs if e["tid"] == T.SLICES_TID and key(e) == key(sec)]
        assert sum(e["dur"] for e in inner) == pytest.approx(sec["dur"], rel=1e-9)
        assert min(e["ts"] for e in inner) == pytest.approx(sec["ts"])


def test_sections_without_collective_starts_are_not_guessed():
    ranks, colls = random_run(world=2, iterations=1)
    colls[K.START_S] = np.nan
    s = T.slices(ranks, colls)
    assert s.empty and len(T.unplaced(ranks, colls)) == len(ranks)
    doc = T.run_trace(ranks, colls)
    assert "only their section range is drawn" in doc["otherData"]["note"]
    assert sum(e["ph"] == "X" and e["cat"] == "section" for e in doc["traceEvents"]) == len(ranks)
    assert sum(e["ph"] == "X" and e["cat"] == "iteration" for e in doc["traceEvents"]) == 2  # one per rank


def test_one_rank_is_all_compute():
    ranks = pd.DataFrame({K.RANK: 0, K.ITERATION: [0, 1], K.SECTION: "s", K.WARMUP: [True, False],
                          K.START_S: [0.0, 1.0], K.SECTION_S: 0.5})  # fmt: skip
    s = T.slices(ranks, pd.DataFrame(columns=list(K.COLLECTIVES_COLUMNS)))
    assert s[K.KIND].tolist() == ["compute", "compute"] and s[K.DURATION_S].tolist() == [0.5, 0.5]


# --- the report's chart: median iteration, ranks drawn ----------------------------------------------


def write_tables(run_dir, ranks, colls):
    from pnpscale.analysis.tables import frames

    gathered = [
        ({"ranks": ranks[ranks[K.RANK] == r].to_dict("records"),
          "collectives": colls[colls[K.RANK] == r].to_dict("records")}, {})
        for r in sorted(ranks[K.RANK].unique())
    ]  # fmt: skip
    r, c = frames(gathered, image_bytes=4096)
    layout.commit_files(run_dir, table_writers(r, c, decompose(r, c)))
    return r


def test_timeline_table_draws_a_readable_subset_whose_slices_add_up(tmp_path):
    from pnpscale.results.timeline_chart import (
        CRITICAL,
        FASTEST,
        ROLE,
        TYPICAL,
        median_iteration,
        plot_timeline,
        timeline_table,
    )

    ranks, colls = random_run(world=12, iterations=4, seed=3)
    ranks[K.PEAK_MEM_BYTES], ranks[K.N_COLLECTIVES], ranks[K.GPU_SPAN_S] = 1, 3, np.nan
    run_dir = tmp_path / layout.point_subdir("2d", "inference", 12)
    written = write_tables(run_dir, ranks, colls)
    view = pd.DataFrame({"problem": "2d", "mode": "inference", "gpus": [12], "section": "all", "status": "complete",
                         "run_dir": str(run_dir)})  # fmt: skip
    tl = timeline_table(view)
    it = median_iteration(written)
    assert set(tl[K.ITERATION]) == {it} and it != 0  # a measured iteration
    drawn = tl.drop_duplicates(K.RANK)
    assert len(drawn) == 8 and set(tl[K.WORLD_SIZE]) == {12}
    assert {CRITICAL, FASTEST, TYPICAL} <= set(drawn[ROLE])
    # the critical rank of each section is drawn: the largest compute S_r - sum_c D_rc of that iteration
    m = written[written[K.ITERATION] == it].set_index([K.SECTION, K.RANK])
    comm = colls[colls[K.ITERATION] == it].groupby([K.SECTION, K.RANK])[K.DURATION_S].sum()
    compute = m[K.SECTION_S] - comm.reindex(m.index)
    for sec, per in compute.groupby(level=K.SECTION):
        assert int(per.droplevel(K.SECTION).idxmax()) in set(drawn[K.RANK]), sec
    # each drawn rank's slices of a section add up to its section time (1 %)
    got = tl.groupby([K.RANK, K.SECTION])[K.DURATION_S].sum()
    want = m[K.SECTION_S].swaplevel().reindex(got.index)
    assert ((got / want - 1).abs() < 0.01).all()
    fig = plot_timeline(tl)
    assert "8 of 12 ranks drawn, 4 not drawn" in fig.axes[0].get_title()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert any("critical" in t for t in labels) and any("fastest" in t for t in labels)


def test_nested_sections_get_their_own_track():
    """An offline analysis with ``step=ProfilerStep#*,gradient``: the step encloses the gradient; their slices
    overlap in time, so they go to different threads (no track holds overlapping slices)."""
    ranks = pd.DataFrame({K.RANK: 0, K.ITERATION: [0, 0, 1, 1], K.SECTION: ["step", "gradient"] * 2,
                          K.WARMUP: False, K.START_S: [0.0, 0.1, 1.0, 1.1],
                          K.SECTION_S: [0.9, 0.5, 0.9, 0.5]})  # fmt: skip
    doc = T.run_trace(ranks, pd.DataFrame(columns=list(K.COLLECTIVES_COLUMNS)))
    tids = {(e["args"]["section"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == T.COMPUTE}
    assert tids == {("step", T.SLICES_TID), ("gradient", T.SLICES_TID + 1)}
    threads = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"]
    assert threads == ["sections", "compute / transfer / wait", "compute / transfer / wait (sections nested 1 deep)",
                       "iterations"]


def test_the_chart_draws_a_hidden_slice_when_the_collectives_have_one(tmp_path):
    from pnpscale.results.timeline_chart import plot_timeline, timeline_table

    ranks, colls = random_run(world=2, iterations=2, seed=5)
    ranks[K.PEAK_MEM_BYTES], ranks[K.N_COLLECTIVES], ranks[K.GPU_SPAN_S] = 1, 3, np.nan
    # the decomposition found each collective blocked over its second half only: the first half is hidden
    half = (0.5 * colls[K.DURATION_S] * 1e9).round().astype("int64")
    full = (colls[K.DURATION_S] * 1e9).round().astype("int64")
    colls[K.BLOCKED_SPANS_NS] = [f"{h}-{f}" for h, f in zip(half, full, strict=True)]
    run_dir = tmp_path / layout.point_subdir("2d", "inference", 2)
    written = write_tables(run_dir, ranks, colls)
    view = pd.DataFrame({"problem": "2d", "mode": "inference", "gpus": [2], "section": "all", "status": "complete",
                         "run_dir": str(run_dir)})  # fmt: skip
    tl = timeline_table(view)
    assert T.HIDDEN in set(tl[K.KIND])
    got = tl[tl[K.KIND].isin(T.TILING)].groupby([K.RANK, K.SECTION])[K.DURATION_S].sum()
    it = int(tl[K.ITERATION].iloc[0])
    want = written[written[K.ITERATION] == it].set_index([K.RANK, K.SECTION])[K.SECTION_S].reindex(got.index)
    assert ((got / want - 1).abs() < 0.01).all()
    legend = [t.get_text() for t in plot_timeline(tl).legends[0].get_texts()]
    assert legend == ["compute", "transfer", "wait", "hidden"]


def test_collective_labels_never_overlap_and_the_title_counts_those_left_out(tmp_path):
    """A training iteration holds dozens of collectives: the chart labels those that fit, none over another,
    and says how many it labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pnpscale.results.timeline_chart import plot_timeline, timeline_table

    ranks, colls = random_run(world=2, iterations=2, seed=2, n_coll=30)
    ranks[K.PEAK_MEM_BYTES], ranks[K.N_COLLECTIVES], ranks[K.GPU_SPAN_S] = 1, 30, np.nan
    run_dir = tmp_path / layout.point_subdir("2d", "training", 2)
    write_tables(run_dir, ranks, colls)
    view = pd.DataFrame({"problem": "2d", "mode": "training", "gpus": [2], "section": "all", "status": "complete",
                         "run_dir": str(run_dir)})  # fmt: skip
    fig = plot_timeline(timeline_table(view))
    ax = fig.axes[0]
    renderer = FigureCanvasAgg(fig).get_renderer()
    texts = [t for t in ax.texts if "all_reduce" in t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    assert 0 < len(texts) < 60
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    assert f"{len(texts)} of 60 collectives labelled" in ax.get_title()


# --- timeline.json against the Trace Event Format and Perfetto's importer (tests/trace_event_format.py) ----


def _written_trace(tmp_path, ranks, colls):
    """timeline.json as the run writer writes it, its text and the checker's verdict."""
    from tests.trace_event_format import check_trace

    layout.commit_files(tmp_path, table_writers(ranks, colls, decompose(ranks, colls)))
    text = (tmp_path / layout.TIMELINE_JSON).read_bytes().decode("utf-8")
    return text, *check_trace(text)


def test_timeline_json_passes_the_format_checks_and_perfetto_reads_the_tiling_to_the_nanosecond(tmp_path):
    """Every rule of the checker holds, and read with Perfetto's µs -> ns rule (the number's text, decimal point
    moved 3 places), each rank's compute / wait / transfer slices abut and fill its section range exactly."""
    from tests.trace_event_format import perfetto_ns

    ranks, colls = random_run(world=3, iterations=2, seed=7)
    ranks[K.SECTION] = ranks[K.SECTION].replace({"denoiser": "débruiteur"})  # a name outside ASCII
    colls[K.SECTION] = colls[K.SECTION].replace({"denoiser": "débruiteur"})
    text, doc, problems = _written_trace(tmp_path, ranks, colls)
    assert problems == [] and "débruiteur" in text
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    spans: dict[tuple, list[tuple[int, int]]] = {}
    for e in xs:
        if e["tid"] == T.SLICES_TID:
            spans.setdefault((e["pid"], e["args"]["iteration"], e["args"]["section"]), []).append(
                (perfetto_ns(e["ts"]), perfetto_ns(e["dur"]))
            )
    sections = {(e["pid"], e["args"]["iteration"], e["args"]["section"]): e for e in xs if e["cat"] == "section"}
    assert set(spans) == set(sections) and len(sections) == len(ranks)
    for key, parts in spans.items():
        parts.sort()
        ts0, dur0 = perfetto_ns(sections[key]["ts"]), perfetto_ns(sections[key]["dur"])
        assert parts[0][0] == ts0 and sum(d for _, d in parts) == dur0, key
        assert all(a + d == b for (a, d), (b, _) in zip(parts[:-1], parts[1:], strict=True)), key  # abut
    # microseconds: rank 0 (pid 1) has the first section range of S_r * 1e6 us
    r0 = ranks[(ranks[K.RANK] == 0) & (ranks[K.ITERATION] == 0) & (ranks[K.SECTION] == "gradient")].iloc[0]
    assert perfetto_ns(sections[(T.PID_BASE, "0", "gradient")]["dur"]) == round(r0[K.SECTION_S] * 1e9)


def test_collectives_in_flight_together_get_hidden_lanes_that_do_not_overlap(tmp_path):
    """Pipelined bands: an async all_reduce done before the rank waits for it (never blocked) while the next
    is in flight: their hidden slices overlap in time, so they go to two threads, each nesting-clean."""
    ranks = pd.DataFrame({K.RANK: [0, 1], K.ITERATION: 0, K.SECTION: "gradient", K.WARMUP: False,
                          K.START_S: 0.0, K.SECTION_S: 1.0})  # fmt: skip
    rows = []
    for rank in (0, 1):
        rows += [
            {K.RANK: rank, K.ITERATION: 0, K.SECTION: "gradient", K.SEQ: 0, K.COLLECTIVE: "all_reduce",
             K.START_S: 0.1, K.DURATION_S: 0.2, K.PAYLOAD_BYTES: 8, K.BLOCKED_SPANS_NS: ""},
            {K.RANK: rank, K.ITERATION: 0, K.SECTION: "gradient", K.SEQ: 1, K.COLLECTIVE: "all_reduce",
             K.START_S: 0.2, K.DURATION_S: 0.3, K.PAYLOAD_BYTES: 8, K.BLOCKED_SPANS_NS: "250000000-300000000"},
        ]  # fmt: skip
    colls = pd.DataFrame(rows)
    _, doc, problems = _written_trace(tmp_path, ranks, colls)
    assert problems == []
    hidden = {(e["pid"], e["args"]["seq"]): e["tid"] for e in doc["traceEvents"] if e.get("cat") == T.HIDDEN}
    assert hidden == {(p, seq): T.HIDDEN_TID + int(seq) for p in (T.PID_BASE, T.PID_BASE + 1) for seq in "01"}
    # on one track the two would overlap without nesting: the checker says so
    from tests.trace_event_format import check_trace

    one = json.loads((tmp_path / layout.TIMELINE_JSON).read_text())
    for e in one["traceEvents"]:
        if e.get("tid") == T.HIDDEN_TID + 1:
            e["tid"] = T.HIDDEN_TID
    assert any("without nesting" in p for p in check_trace(json.dumps(one))[1])


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    """A 2-rank, 1-iteration timeline.json as the run writer writes it (text), written once for the module."""
    ranks, colls = random_run(world=2, iterations=1)
    text, _, problems = _written_trace(tmp_path_factory.mktemp("trace"), ranks, colls)
    assert problems == []
    return text


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda t: t.replace('"dur":', '"dur":NaN,"x":', 1), "NaN is not JSON"),
        (lambda t: t.replace('"args":{"section"', '"stack":[1],"args":{"section"', 1), "holds an array"),
        (lambda t: t.replace('"ts":', '"tts":', 1), "is not a number of microseconds"),
        (lambda t: t.replace('"pid":1,', '"pid":"1",', 1), "not an unsigned 32-bit integer"),
        (lambda t: t.replace('"pid":1,', '"pid":0,', 1), "pid 0 (Perfetto's idle"),
        (lambda t: t.replace('"thread_name","args":{"name":"sections"}', '"thread_nam","args":{}', 1), "'thread_nam'"),
        (lambda t: t.replace('{"name":"sections"}', '{"name":"s\\u00e9ctions"}', 1), "\\u escape"),
        (lambda t: t.replace('"displayTimeUnit":"ms"', '"displayTimeUnit":"s"'), "displayTimeUnit"),
    ],
)
def test_the_format_checker_catches_each_rule(small_trace, edit, problem):
    """The checker is not vacuous: each broken rule of a written trace is named."""
    from tests.trace_event_format import check_trace

    broken = edit(small_trace)
    assert broken != small_trace
    try:
        found = check_trace(broken)[1]
    except ValueError as exc:  # NaN: the parse itself stops, as Perfetto's does
        found = [str(exc)]
    assert any(problem in p for p in found), found


def test_the_timeline_computed_in_a_forked_process_is_the_one_computed_here(tmp_path, monkeypatch):
    """An offline analysis reading with several processes starts the timeline in a child while it decomposes
    (TimelineJob): the same text; an error of its computation is raised as it would be here; a child that dies
    leaves the text to this process; closed, it holds no process."""
    import multiprocessing as mp
    from concurrent.futures.process import BrokenProcessPool

    from pnpscale.analysis.tables import TimelineJob, timeline_text

    ranks, colls = random_run(world=3, iterations=2)
    colls = colls.assign(**{K.MAIN: True})
    here = timeline_text(ranks, colls)
    job = TimelineJob(ranks, colls)
    assert job.text() == here and job._pool is None
    layout.commit_files(tmp_path / "a", table_writers(ranks, colls, decompose(ranks, colls), TimelineJob(ranks, colls)))
    assert (tmp_path / "a" / layout.TIMELINE_JSON).read_text(encoding="utf-8") == here

    bad = ranks.copy()
    bad.loc[0, K.SECTION_S] = np.inf  # a non-finite time: refused, in the child as here
    with pytest.raises(OverflowError) as here_exc:
        timeline_text(bad, colls)
    with pytest.raises(OverflowError) as child_exc:
        TimelineJob(bad, colls).text()
    assert str(child_exc.value) == str(here_exc.value)

    class Dead:
        def result(self) -> str:
            raise BrokenProcessPool("a child process terminated abruptly")

    job = TimelineJob(ranks, colls)
    job._future = Dead()  # type: ignore[assignment]
    assert job.text() == here
    job = TimelineJob(ranks, colls)
    job.close()
    job.close()
    assert job._pool is None and not [p for p in mp.active_children() if p.is_alive()]


def test_an_unknown_payload_or_collective_name_is_null_in_the_slices_args():
    ranks, colls = random_run(world=2, iterations=1)
    colls = colls.assign(**{K.MAIN: True}).astype({K.PAYLOAD_BYTES: "Int64", K.COLLECTIVE: "string"})
    colls.loc[colls[K.SEQ] == 0, K.PAYLOAD_BYTES] = pd.NA
    colls.loc[colls[K.SEQ] == 1, K.COLLECTIVE] = pd.NA
    from pnpscale.analysis.tables import timeline_text

    xs = [e for e in json.loads(timeline_text(ranks, colls))["traceEvents"] if e["ph"] == "X"]
    comm = [e["args"] for e in xs if e["cat"] in (T.WAIT, T.TRANSFER)]
    by_seq = {s: [(a["collective"], a["bytes"]) for a in comm if a["seq"] == s] for s in (0, 1, 2)}
    assert by_seq[0] and set(by_seq[0]) == {("all_reduce", None)}
    assert by_seq[1] and set(by_seq[1]) == {(None, 4096)}
    assert set(by_seq[2]) == {("all_reduce", 4096)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_encoded_timeline_holds_the_values_json_writes(seed):
    """msgspec's encoder writes what :func:`json.dumps` (``allow_nan=False``) writes, value for value: section
    names outside ASCII as they are, section times of every size (``1e-05`` is ``0.00001`` there)."""
    from pnpscale.analysis.tables import timeline_text

    ranks, colls = random_run(world=3, iterations=2, seed=seed)
    colls = colls.assign(**{K.MAIN: True})
    ranks[K.SECTION] = ranks[K.SECTION].replace({"gradient": "gradient ∇ é"})
    colls[K.SECTION] = colls[K.SECTION].replace({"gradient": "gradient ∇ é"})
    ranks.loc[0, K.SECTION_S] = 1.25e-5  # written in the args as it is
    text = timeline_text(ranks, colls)
    want = json.dumps(T.run_trace(ranks, colls), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    assert json.loads(text) == json.loads(want)
    assert "gradient ∇ é" in text and "\\u" not in text
    assert '"section_s":0.0000125' in text


def test_a_non_finite_section_time_or_clock_offset_is_refused_not_written_as_null():
    ranks, colls = random_run(world=2, iterations=1)
    table = T.slices(ranks, colls)
    bad = ranks.copy()
    bad.loc[1, K.SECTION_S] = np.nan  # placed from its start (CPU): its range is written, with S_r in its args
    with pytest.raises(ValueError, match=r"rank 1 iteration 0 section 'gradient': section_s nan is not a number"):
        T.chrome_trace(table, bad)
    with pytest.raises(ValueError, match="clock offsets"):
        T.chrome_trace(table, ranks, {0: 0.0, 1: float("nan")})
