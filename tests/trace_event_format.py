"""A strict checker of ``timeline.json`` against the Chrome Trace Event Format and Perfetto's JSON importer.

No Perfetto trace processor can run here: the ``perfetto`` wheel on PyPI ships the Python API only and
downloads its ``trace_processor_shell`` binary from the internet on first use (checked for perfetto 0.59.1).
So the rules are checked one by one instead. Sources:

* the Trace Event Format document (Google, "Trace Event Format", the JSON Object Format): ``traceEvents``;
  per phase ``X`` (complete: ``ts`` and ``dur`` in microseconds), ``i`` (instant: ``ts``, scope ``s`` in g/p/t),
  ``M`` (metadata: ``process_name``, ``process_sort_index``, ``thread_name``, ``thread_sort_index`` with their
  ``args``); ``pid`` / ``tid`` integers; ``displayTimeUnit`` ``"ms"`` or ``"ns"``;
* Perfetto's importer (``src/trace_processor/importers/json/``: ``json_trace_tokenizer.cc``,
  ``json_utils.cc``, ``json_trace_parser_impl.cc``):
  - a value must start with ``[ { digit - " t f n``: ``NaN`` and ``Infinity`` end the import (fatal);
  - an event holding an array-valued key is refused with "unsupported JSON dictionary with array" (fatal);
  - an event other than ``M`` without ``ts`` is dropped (counted in ``json_tokenizer_failure`` only);
  - ``pid`` / ``tid`` are read as unsigned 32-bit integers; ``ts`` / ``dur`` (µs) become integer nanoseconds
    by moving the decimal point 3 places in the number's *text* (further digits are cut);
  - older importers reject ``\\u`` escapes in strings, and name a thread by its ``tid`` alone (so a tid
    must carry one name in every process);
  - pid / tid 0 are the idle ("swapper") process, and some versions map a trace's pid / tid 0 onto it;
  - slices on one thread must nest (two slices that overlap without one containing the other are not
    both shown as they were written);
  - flow events (``s`` / ``t`` / ``f``, v1) carry an ``id`` and a ``cat``; with ``bp`` ``e`` each binds to the
    slice enclosing its ``ts`` on its thread (without one, the flow is dropped); one flow starts once and
    finishes once.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

PHASES = {"X", "i", "I", "M", "s", "t", "f"}  # the phases timeline.json may use
FLOWS = {"s", "t", "f"}  # flow events (v1): bound to the slice enclosing their ts on their thread
METADATA = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
            "thread_sort_index": "sort_index", "process_labels": "labels"}  # fmt: skip
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?\Z")


def perfetto_ns(text: str) -> int:
    """A JSON number in microseconds as Perfetto's importer turns it into integer nanoseconds
    (``json::CoerceToTs``: the decimal point moved 3 places right in the text, extra digits cut).

    >>> perfetto_ns("1234.567"), perfetto_ns("0.001"), perfetto_ns("12"), perfetto_ns("1.5e3"), perfetto_ns("0.0")
    (1234567, 1, 12000, 1500000, 0)
    """
    if not _NUMBER.match(text):
        raise ValueError(f"not a JSON number: {text!r}")
    mantissa, _, exp = text.lower().partition("e")
    shift = int(exp) if exp else 0
    whole, _, frac = mantissa.partition(".")
    digits = whole + frac
    size = max(1, len(whole) + shift + 3)
    return int(digits[:size].ljust(size, "0"))


class _Int(str):
    """A JSON integer, kept as its text."""


class _Float(str):
    """A JSON number with a fraction or exponent, kept as its text."""


def _ns_or_none(value: object) -> int | None:
    """A ``ts`` / ``dur`` in µs as Perfetto's importer reads it, in ns (:func:`perfetto_ns`); None if not a number."""
    if not isinstance(value, (_Int, _Float)):
        return None
    try:
        return perfetto_ns(value)
    except ValueError:
        return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON: Perfetto's importer stops at it")


def check_trace(text: str) -> tuple[dict[str, Any], list[str]]:
    """Parse ``text`` (a whole ``timeline.json``) and list every rule it breaks (empty: none).

    Returns:
        the parsed document (numbers of ``ts`` / ``dur`` kept as their JSON text, see :func:`perfetto_ns`)
        and the problems, each naming the event index.
    """
    problems: list[str] = []
    if "\\u" in text:
        problems.append("a \\u escape: older Perfetto importers refuse it")
    doc = json.loads(text, parse_constant=_refuse_constant, parse_float=_Float, parse_int=_Int)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return doc, ["not a JSON object with a traceEvents array"]
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {doc['displayTimeUnit']!r} is not 'ms' or 'ns'")
    named_threads: dict[tuple[int, int], str] = {}
    named_processes: set[int] = set()
    used: set[tuple[int, int]] = set()
    slices: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    flows: list[tuple[int, int, int, str, str, int]] = []
    for i, e in enumerate(doc["traceEvents"]):
        where = f"event {i}"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        for key, v in e.items():
            if isinstance(v, list):
                problems.append(f"{where}: key {key!r} holds an array (Perfetto refuses the trace)")
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"{where}: phase {ph!r} not one of {sorted(PHASES)}")
            continue
        if not isinstance(e.get("name"), str) or not e["name"]:
            problems.append(f"{where}: no name")
        ids = {}
        for key in ("pid", "tid"):
            v = e.get(key)
            if v is None:
                continue
            if not (type(v) is _Int and v.isdigit() and int(v) < 2**32):
                problems.append(f"{where}: {key} {v!r} is not an unsigned 32-bit integer")
                continue
            ids[key] = int(v)
            e[key] = int(v)
            if ids[key] == 0:
                problems.append(f"{where}: {key} 0 (Perfetto's idle 'swapper' process; some versions fold it in)")
        if "pid" not in ids:
            problems.append(f"{where}: no pid")
            continue
        if ph == "M":
            arg = METADATA.get(e.get("name"))
            args = e.get("args")
            if arg is None or not isinstance(args, dict) or arg not in args:
                problems.append(f"{where}: metadata {e.get('name')!r} without args.{arg}")
                continue
            if arg == "name" and not isinstance(args["name"], str):
                problems.append(f"{where}: args.name is not a string")
            if arg == "sort_index" and type(args["sort_index"]) is not _Int:
                problems.append(f"{where}: args.sort_index is not an integer")
            if e["name"].startswith("thread_"):
                if "tid" not in ids:
                    problems.append(f"{where}: {e['name']} without tid")
                elif e["name"] == "thread_name":
                    key = (ids["pid"], ids["tid"])
                    if key in named_threads:
                        problems.append(f"{where}: thread {key} named twice")
                    named_threads[key] = args["name"]
            elif e["name"] == "process_name":
                named_processes.add(ids["pid"])
            continue
        if "tid" not in ids:
            problems.append(f"{where}: {ph} event without tid")
            continue
        ts = _ns_or_none(e.get("ts"))
        if ts is None or ts < 0:
            problems.append(f"{where}: ts {e.get('ts')!r} is not a number of microseconds >= 0 (dropped on import)")
            continue
        if not isinstance(e.get("args", {}), dict):
            problems.append(f"{where}: args is not an object")
        if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where}: instant scope {e.get('s')!r} not g/p/t")
        if ph == "X":
            dur = _ns_or_none(e.get("dur"))
            if dur is None or dur < 0:
                problems.append(f"{where}: dur {e.get('dur')!r} is not a number of microseconds >= 0")
                continue
            slices[(ids["pid"], ids["tid"])].append((ts, ts + dur, i))
        if ph in FLOWS:
            if type(e.get("id")) is not _Int or not isinstance(e.get("cat"), str) or e.get("bp") != "e":
                problems.append(f"{where}: flow event without an integer id, a cat, or bp 'e'")
            flows.append((ids["pid"], ids["tid"], ts, ph, str(e.get("id")), i))
        used.add((ids["pid"], ids["tid"]))
    for pid, tid, ts, ph, fid, i in flows:
        if not any(a <= ts < b for a, b, _ in slices.get((pid, tid), [])):
            problems.append(f"event {i}: flow {fid} ({ph}) at {ts} ns lies in no slice of (pid {pid}, tid {tid})")
    ends = defaultdict(list)
    for *_, ph, fid, _i in flows:
        ends[fid].append(ph)
    for fid, phs in ends.items():
        if phs.count("s") != 1 or phs.count("f") != 1:
            problems.append(f"flow {fid}: {phs.count('s')} start(s) and {phs.count('f')} finish(es), need one each")
    names_of_tid: dict[int, set[str]] = defaultdict(set)
    for (_, tid), name in named_threads.items():
        names_of_tid[tid].add(name)
    for tid, names in sorted(names_of_tid.items()):  # an importer naming threads by tid alone names them right
        if len(names) > 1:
            problems.append(f"tid {tid} is named {sorted(names)} in different processes")
    for pid, tid in sorted(used - set(named_threads)):
        problems.append(f"thread (pid {pid}, tid {tid}) has slices but no thread_name")
    for pid in sorted({p for p, _ in used} - named_processes):
        problems.append(f"process {pid} has slices but no process_name")
    for track, spans in slices.items():  # nesting: each slice inside or after the open ones
        stack: list[tuple[int, int, int]] = []
        for start, end, i in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                problems.append(f"event {i}: overlaps event {stack[-1][2]} on {track} without nesting in it")
            stack.append((start, end, i))
    return doc, problems
