"""Real 2- and 4-rank gloo jobs whose communication overlaps computation (tests/overlap_jobs.py), analysed by
``python -m pnpscale.analyze``; the truth is each job's own wall clock (``time.perf_counter`` around its
collective calls and ``wait()``, DDP's through its comm hook).

Tolerance: the communication share of each rank x section (summed over the measured iterations) within
10 points of the blocked share the job measured itself. The machine these run on is shared and loaded: a
thread preempted while a collective is in flight and no operator runs looks blocked in the trace but is
outside the job's timed calls; the jobs use 60-80 ms of compute against collectives of a few ms to keep
the signal well above that. The job's clock also counts what the trace cannot see: the wake-up latency
after a collective ends until ``wait()`` returns (milliseconds when the machine is loaded); short blocking
sections (the last rank's, a few ms) are made longer (16 MB) to keep it small beside them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from tests import overlap_jobs

pytestmark = pytest.mark.slow
POINTS = 10.0  # percentage points


def _analyse(
    tmp: Path, job: str, sections: str, world: int = 2, load: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    out = overlap_jobs.run(job, tmp / job, world=world, load=load, timeout_s=400)
    code = main([str(out / "traces"), "--sections", sections, "--warmup", "1", "--out", str(out / "analysis")])
    assert code == 0, f"{job}: the analysis refused the job"
    ranks = pd.read_parquet(out / "analysis" / "ranks.parquet")
    truth = pd.DataFrame(overlap_jobs.truth(out))
    m = ranks.merge(truth, on=[K.RANK, K.ITERATION, K.SECTION], how="inner", validate="one_to_one")
    assert len(m) == len(ranks)
    m = m[~m[K.WARMUP]]
    g = m.groupby([K.SECTION, K.RANK])[[K.COMM_S, K.SECTION_S, K.HIDDEN_S, "blocked_s", "wall_s"]].sum()
    g["share"] = 100 * g[K.COMM_S] / g[K.SECTION_S]
    g["truth"] = 100 * g["blocked_s"] / g["wall_s"]
    doc = json.loads((out / "analysis" / ANALYSIS_JSON).read_text())
    return g, pd.read_parquet(out / "analysis" / "sections.parquet"), doc


def _agree(g: pd.DataFrame, points: float = POINTS) -> None:
    off = (g["share"] - g["truth"]).abs()
    assert (off <= points).all(), f"communication share vs the job's blocked time:\n{g.round(4)}"


def _comm_e_at_most_1(doc: dict) -> None:
    for m in (doc["metrics"], *doc["metrics"]["sections"].values()):
        assert m["comm_e"] is None or m["comm_e"] <= 1 + 1e-12
        if m["comm_e"] is not None:
            assert m["pe"] == pytest.approx(m["lb"] * m["comm_e"])


@pytest.mark.parametrize("job", ["ddp", "ddp_default"])
def test_ddp_with_several_buckets(tmp_path, job):
    """resnet18 at 32x32 under DDP, gradient buckets all_reduced while backward runs (default buckets, and
    bucket_cap_mb=8)."""
    g, sections, doc = _analyse(tmp_path, job, "forward,backward")
    _agree(g)
    _comm_e_at_most_1(doc)
    backward = sections[(sections[K.SECTION] == "backward") & ~sections[K.WARMUP]]
    assert (backward[K.N_COLLECTIVES] >= 2).all()
    assert backward[K.HIDDEN_S].sum() > 0  # buckets reduced while backward computes
    assert not [a for a in doc["anomalies"] if a["kind"] == "negative_compute"]


def test_hidden_async_all_reduce(tmp_path):
    """An async all_reduce behind 80 ms of compute: wait() returns at once, the collective shows as hidden."""
    g, sections, doc = _analyse(tmp_path, "hidden", "overlap")
    _agree(g)
    _comm_e_at_most_1(doc)
    assert (g["share"] < POINTS).all()
    assert doc["metrics"]["sections"]["overlap"]["hidden_share"] > 0.5
    assert (g[K.HIDDEN_S] > 0).all()


def test_two_concurrent_async_all_reduces(tmp_path):
    """Two async all_reduces in flight together; rank 0 waits for rank 1's 60 ms of compute on both."""
    g, sections, doc = _analyse(tmp_path, "concurrent", "overlap")
    _agree(g)
    _comm_e_at_most_1(doc)
    assert g.loc[("overlap", 0), "share"] > 50  # rank 0: blocked most of the section, counted once
    assert (sections[K.N_COLLECTIVES] == 2).all()


def test_collective_free_imbalanced_section(tmp_path):
    """A section without collectives in which rank 1 works 60 ms longer: CommE 1, PE = LB."""
    g, sections, doc = _analyse(tmp_path, "imbalanced", "work,sync")
    work = doc["metrics"]["sections"]["work"]
    assert work["comm_e"] == pytest.approx(1.0) and work["pe"] == pytest.approx(work["lb"])
    wall = g.loc["work", "wall_s"]
    assert work["lb"] == pytest.approx(wall.mean() / wall.max(), abs=0.1)
    _comm_e_at_most_1(doc)
    _agree(g.loc[["work"]])
    # the blocking all_reduce after it: never more than the job's own blocked time; the last rank to arrive
    # (a section of ~20 ms) can lose the wake-up latency after the collective's end (invisible in the trace;
    # 5 ms per iteration was seen when the machine was loaded)
    assert (g.loc["sync", "share"] <= g.loc["sync", "truth"] + POINTS).all()
    assert g.loc[("sync", 0), "share"] == pytest.approx(g.loc[("sync", 0), "truth"], abs=POINTS)


def test_fsdp_reduce_scatter_is_typed_from_its_c10d_call(tmp_path):
    """FSDP on CPU: gloo runs the gradients' reduce_scatter as ``gloo:all_reduce``; the c10d call names it."""
    out = overlap_jobs.run("fsdp", tmp_path / "fsdp")
    assert main([str(out / "traces"), "--sections", "step", "--out", str(out / "analysis")]) == 0
    colls = pd.read_parquet(out / "analysis" / "collectives.parquet")
    per_it = colls.groupby([K.RANK, K.ITERATION])[K.COLLECTIVE].apply(list)
    assert all(v == ["all_gather", "reduce_scatter"] for v in per_it), per_it
    doc = json.loads((out / "analysis" / ANALYSIS_JSON).read_text())
    assert any(a["kind"] == "range_name_disagrees" for a in doc["anomalies"])


# --- issue 34: past the blocking shape ---------------------------------------------------------


def test_ddp_default_buckets_at_4_ranks_under_load(tmp_path):
    """resnet18 under DDP with its default 25 MB buckets, 4 ranks and a process spinning on the 2 cores: the
    buckets' waits that gloo's worker closes late are blocked, within 8 points of the job's clock."""
    g, sections, doc = _analyse(tmp_path, "ddp_default", "forward,backward", world=4, load=1)
    _agree(g, 8.0)
    _comm_e_at_most_1(doc)


def test_future_wait_pinned_to_one_core(tmp_path):
    """Rank 1 sleeps 50 ms, then both ``all_reduce(async_op=True).get_future().wait()``, both ranks on one core:
    rank 0's wait is blocked although gloo may close its range after the thread resumed."""
    g, sections, doc = _analyse(tmp_path, "future_wait", "sync")
    _agree(g, 8.0)
    _comm_e_at_most_1(doc)
    assert g.loc[("sync", 0), "share"] > 50


def _pipeline_blocked(tmp_path, job: str, **kw):
    """Run the pipeline job ``job``, analyse its traces (sections forward, backward; 1 warm-up): (its folder, per
    section and rank over the measured iterations the analysis' COMM_S beside the job's own blocked_s)."""
    out = overlap_jobs.run(job, tmp_path / job, **kw)
    code = main([str(out / "traces"), "--sections", "forward,backward", "--warmup", "1", "--out", str(out / "a")])
    assert code == 0
    ranks = pd.read_parquet(out / "a" / "ranks.parquet")
    truth = pd.DataFrame(overlap_jobs.truth(out))
    m = ranks.merge(truth, on=[K.RANK, K.ITERATION, K.SECTION], validate="one_to_one")
    return out, m[~m[K.WARMUP]].groupby([K.SECTION, K.RANK])[[K.COMM_S, "blocked_s"]].sum()


def test_pipeline_send_recv_with_a_known_delay(tmp_path):
    """A 2-stage pipeline: stage 1 receives stage 0's activations after its 60 ms of compute (send/recv), stage 0
    receives stage 1's gradients after its 40 ms (isend/irecv): each receiver's blocked time within 20 % of its
    own clock, split into wait (the sender's delay) and transfer."""
    out, m = _pipeline_blocked(tmp_path, "pipeline")
    for receiver in (("forward", 1), ("backward", 0)):
        assert m.loc[receiver, K.COMM_S] == pytest.approx(m.loc[receiver, "blocked_s"], rel=0.2), m
    colls = pd.read_parquet(out / "a" / "collectives.parquet")
    assert set(colls[K.COLLECTIVE]) == {"send_recv"}
    sections = pd.read_parquet(out / "a" / "sections.parquet")
    measured = sections[~sections[K.WARMUP]]
    # the receivers wait for the senders: in every iteration, and by far in the median one (an iteration whose
    # receiver lost the core after the sender arrived reads a few ms of transfer: seen on a loaded 2-core machine)
    assert (measured[K.WAIT_S] > measured[K.TRANSFER_S]).all(), measured
    median = measured.groupby(K.SECTION)[[K.WAIT_S, K.TRANSFER_S]].median()
    assert (median[K.WAIT_S] > 10 * median[K.TRANSFER_S]).all(), median
    doc = json.loads((out / "a" / ANALYSIS_JSON).read_text())
    _comm_e_at_most_1(doc)
    # per pair: the 3 measured iterations' transfers (no shapes recorded: bytes may be unknown, never invented)
    pairs = {(p["section"], p["src"], p["dst"]): p for p in doc["point_to_point"]}
    assert set(pairs) == {("forward", 0, 1), ("backward", 1, 0)}
    assert all(p["transfers"] == 3 and p["bytes"] in (None, 3 << 20) for p in pairs.values()), pairs


@pytest.mark.parametrize("world", [3])
def test_pipeline_of_more_stages_pairs_by_the_recorded_peers(tmp_path, world, capsys):
    """A 3-stage pipeline profiled with record_shapes (stage i sends to i+1 after its compute, gradients back with
    tag 1): every receiver's blocked time within 20 % of its own clock; each transfer on its two ranks in
    collectives.parquet. The same traces without the peers (no 'Concrete Inputs': recorded without shapes) are
    refused, naming rank, iteration and section."""
    out, m = _pipeline_blocked(tmp_path, "pipeline_n", world=world)
    receivers = [("forward", r) for r in range(1, world)] + [("backward", r) for r in range(world - 1)]
    for receiver in receivers:
        assert m.loc[receiver, K.COMM_S] == pytest.approx(m.loc[receiver, "blocked_s"], rel=0.2), m
    colls = pd.read_parquet(out / "a" / "collectives.parquet")
    held = colls.groupby(K.PROCESS_GROUP)[K.RANK].unique().map(sorted).to_dict()
    assert held == {**{f"p2p:{i}->{i + 1}": [i, i + 1] for i in range(world - 1)},
                    **{f"p2p:{i + 1}->{i}": [i, i + 1] for i in range(world - 1)}}  # fmt: skip
    doc = json.loads((out / "a" / ANALYSIS_JSON).read_text())
    _comm_e_at_most_1(doc)
    # per pair and section over the 3 measured iterations: 1 MiB each, the rate from the pair's t_c
    pairs = {(p["section"], p["src"], p["dst"]): p for p in doc["point_to_point"]}
    assert set(pairs) == {*(("forward", i, i + 1) for i in range(world - 1)),
                          *(("backward", i + 1, i) for i in range(world - 1))}  # fmt: skip
    assert all(p["transfers"] == 3 and p["bytes"] == 3 << 20 and p["rate_gb_s"] > 0 for p in pairs.values()), pairs
    for p in pairs.values():
        assert p["rate_gb_s"] == pytest.approx(p["bytes"] / p["transfer_s"] / 1e9)
    assert "point-to-point, per pair" in capsys.readouterr().out
    bare = out / "bare"
    bare.mkdir()
    for f in (out / "traces").glob("*.json"):
        doc = json.loads(f.read_text())
        for e in doc["traceEvents"]:
            (e.get("args") or {}).pop("Concrete Inputs", None)
        (bare / f.name).write_text(json.dumps(doc))
    capsys.readouterr()
    assert main([str(bare), "--sections", "forward,backward", "--warmup", "1", "--out", str(out / "b")]) != 0
    assert "record_shapes=True" in capsys.readouterr().err


def test_prefetch_collective_is_waited_in_the_next_section(tmp_path):
    """An all_reduce issued at the end of 'issue' (gloo starts it after the section closed on some ranks) and
    waited in 'use': analysed, its wait in 'use', every section within 8 points of the job's clock. The job
    computes 60 / 120 ms and 40 ms: with half that, a CI run read rank 0's 'issue' 8.7 points under its clock
    (the issuing call preempted, a large part of a short section); within 3 points in 7 runs since."""
    g, sections, doc = _analyse(tmp_path, "prefetch", "issue,use")
    _agree(g, 8.0)
    _comm_e_at_most_1(doc)
    assert (g.loc["use", "share"] > g.loc["issue", "share"]).all()


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2(tmp_path, world):
    """FSDP2 (``fully_shard``) on CPU: all_gathers in forward, reduce_scatters in backward, their calls and waits
    timed by the job through ``dist.*``: within 10 points, gloo's copies inside the c10d calls counted as
    communication. 16 MB layers: the per-collective costs the trace counts as compute (gloo's wake-up latency, the
    wrappers' Python) were 12-14 points of a 2-rank forward with 1 MB ones on a loaded machine, and up to 10.1
    points of a 4-rank forward with 4 MB ones (4 ranks on 2 cores); 0.4-4.5 points with 16 MB ones."""
    g, sections, doc = _analyse(tmp_path, "fsdp2", "forward,backward", world=world)
    _agree(g, 10.0)
    _comm_e_at_most_1(doc)
