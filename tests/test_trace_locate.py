"""The fast pass finds the events it decodes whole from where msgspec's ``ts`` view lies in the batch
(:func:`pnpscale.analysis.trace.scan.located_event`), instead of decoding the batch a second time: on any layout the
event found is the event (or none is, and the batch's second decoding gives it)."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pnpscale.analysis.trace import scan as T
from pnpscale.analysis.trace.collect import Collector

pytestmark = pytest.mark.quick


def _state() -> T.ScanState:
    return T.ScanState(Collector({"gradient": "gradient"}, path=Path("r.json")))


def _exact(text: bytes) -> list[dict]:
    return json.loads(text, parse_float=Decimal)


def _kineto(name: str, ts: str, **args: object) -> str:
    """An event as Kineto writes it: ``ph`` first, ``args`` last, numbers as ``{us}.{ns:03}``."""
    body = json.dumps(args, indent=6)
    return (f'  {{\n    "ph": "X", "cat": "cpu_op", "name": {json.dumps(name)}, "pid": 7, "tid": 7,\n'
            f'    "ts": {ts}, "dur": 1.500,\n    "args": {body}\n  }}')  # fmt: skip


def test_events_in_kineto_layout_are_found_without_decoding_the_batch_again(monkeypatch):
    events = [
        _kineto("gradient", "100.000", **{"External id": 1}),
        _kineto("caf\u00e9 \u2192 k", "101.250", note="non-ASCII before and after ts"),
        _kineto("gloo:all_reduce", "102.000", inner={"ph": "X", "ts": 5}, dims=[[4]]),
        _kineto("denoiser", "103.000"),
    ]
    batch = ("[" + ",\n".join(events) + "]").encode()
    evs = T._TYPED.decode(batch)
    base = T.np.frombuffer(batch, T.np.uint8).ctypes.data
    state = _state()
    assert [T.located_event(state, batch, evs, i, base) for i in range(4)] == _exact(batch)

    def no_second_decoding(_batch: bytes) -> None:
        raise AssertionError("the batch was decoded a second time")

    monkeypatch.setattr(T, "_RAWS", type("R", (), {"decode": staticmethod(no_second_decoding)})())
    whole = T.WholeEvents(state, batch, evs)
    assert [whole[i] for i in (3, 0)] == [_exact(batch)[3], _exact(batch)[0]]


def test_an_event_that_cannot_be_shown_to_be_found_is_taken_from_the_second_decoding():
    first_not_ph = '{"name": "gradient", "ph": "X", "cat": "cpu_op", "ts": 1.000, "dur": 1.000}'
    nested_after = '{"ph": "X", "args": {"a": {"ph": "i", "b": {"ph": 1}}, "c": {"ph": 2}}, "ts": 2.000}'
    no_ts = '{"ph": "X", "cat": "cpu_op", "name": "gradient", "dur": 1.000}'
    string_ts = '{"ph": "X", "cat": "cpu_op", "name": "gradient", "ts": "3.000"}'
    batch = ("[" + ", ".join([first_not_ph, nested_after, no_ts, string_ts]) + "]").encode()
    evs = T._TYPED.decode(batch)
    base = T.np.frombuffer(batch, T.np.uint8).ctypes.data
    state = _state()
    got = [T.located_event(state, batch, evs, i, base) for i in range(4)]
    exact = _exact(batch)
    assert got[0] is None  # "ph" is not the first key: the previous "{" found is not this event's
    assert got[1] == exact[1]  # three nested objects passed on the way back, within the tries
    assert got[2] is None  # no ts to start from
    assert got[3] == exact[3]  # the ts view is a string's: still inside the event
    whole = T.WholeEvents(state, batch, evs)
    assert [whole[i] for i in range(4)] == exact
    assert whole.raws is not None  # the first event needed the second decoding


def test_a_raw_that_is_not_a_view_of_the_batch_is_not_located():
    batch = b'[{"ph": "X", "ts": 1.000}]'
    base = T.np.frombuffer(batch, T.np.uint8).ctypes.data
    assert T.raw_offset(msgspec.Raw(b"1.000"), base, len(batch)) is None  # a copy, elsewhere in memory
    (ev,) = T._TYPED.decode(batch)
    assert T.raw_offset(ev.ts, base, len(batch)) == batch.index(b"1.000")
    assert T.raw_offset(msgspec.Raw(), base, len(batch)) is None


_scalar = st.one_of(st.integers(-5, 5), st.text(" {}[]\":,ph\\é", max_size=6), st.just(None), st.booleans())
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["ph", "ts", "a", "name", "{\"ph\""]), inner, max_size=3),
    ),
    max_leaves=8,
)


@st.composite
def _event(draw: st.DrawFn) -> dict:
    keys = {"ph": draw(st.sampled_from(["X", "i", "s"])), "cat": "cpu_op", "name": draw(st.text(max_size=4))}
    if draw(st.booleans()):
        keys["ts"] = Decimal(draw(st.integers(0, 10**6))) / 1000
    if draw(st.booleans()):
        keys["args"] = draw(st.dictionaries(st.sampled_from(["ph", "x", "External id"]), _json, max_size=3))
    order = draw(st.permutations(list(keys)))
    return {k: keys[k] for k in order}


def _dumps(ev: dict, indent: int | None) -> str:
    text = json.dumps(ev, indent=indent, ensure_ascii=False, default=str)
    if "ts" in ev:  # a number, as Kineto writes it, not the string json made of the Decimal
        text = text.replace(f'"ts": "{ev["ts"]}"', f'"ts": {ev["ts"]}')
    return text


@settings(max_examples=300, deadline=None)
@given(st.lists(_event(), min_size=1, max_size=6), st.sampled_from([None, 0, 2]), st.sampled_from([", ", ",\n  "]))
@example(  # a plain event followed by events whose "ph" is not their first key: not located, taken from the decoding
    [{"ph": "X", "cat": "cpu_op", "name": ""}, {"ph": "X", "cat": "cpu_op", "name": "", "ts": Decimal("0")},
     {"cat": "cpu_op", "ph": "X", "name": "", "ts": Decimal("0"), "args": {"x": None, "ph": None}},
     {"cat": "cpu_op", "ph": "X", "name": ""}, {"cat": "cpu_op", "ph": "X", "name": ""}],
    None,
    ", ",
)  # fmt: skip
def test_the_event_located_is_always_the_event(events, indent, sep):
    batch = ("[" + sep.join(_dumps(e, indent) for e in events) + "]").encode()
    exact = _exact(batch)
    try:
        evs = T._TYPED.decode(batch)
    except msgspec.ValidationError:  # a field of another type: the batch is decoded event by event instead
        return
    base = T.np.frombuffer(batch, T.np.uint8).ctypes.data
    state = _state()
    for i, want in enumerate(exact):
        if type(evs[i]) is not T.EventFields:
            continue  # only X events are decoded whole
        got = T.located_event(state, batch, evs, i, base)
        assert got is None or got == want, i
        # the plain case is found: the event and the next (its end is found at the next event's start) as Kineto
        # writes them, "ph" first (another layout may take more than the tries that located_event makes)
        plain = list(want)[0] == "ph" and "ts" in want and "ph" not in json.dumps(want.get("args"), default=str)
        if plain and (i + 1 == len(exact) or list(exact[i + 1])[0] == "ph"):
            assert got == want, i
    whole = T.WholeEvents(state, batch, evs)
    xs = [i for i, e in enumerate(evs) if type(e) is T.EventFields]
    assert [whole[i] for i in xs] == [exact[i] for i in xs]
