"""The read floor of offline trace analysis, measured beside ``python -m pnpscale.analyze`` in one run.

On the same gzip'd Kineto traces (``../shared/tools/htabench/gen.py --out DIR --ranks R --target-mb M --gz``
or ``benchmarks/kineto_gen.py``), each variant runs in its own process, alternately for ``--rounds``
rounds, first on one rank's file ("1 rank") then on all of them one after the other in one process
("N ranks", one core), and ``pnpscale`` also with its default ``--jobs`` (one process per CPU):

* ``gzip CLI``: ``gzip -dc FILE > /dev/null``;
* ``zlib`` / ``isal`` / ``zlib-ng``: decompress only (the whole file into memory: what a JSON decoder
  then needs), with Python's ``zlib``, ``isal.isal_zlib`` and ``zlib_ng.zlib_ng`` where installed;
* ``orjson``: fastest decompressor + ``orjson.loads`` (dicts of every event);
* ``msgspec typed``: fastest decompressor + ``msgspec.json`` typed decoding into structs holding only
  the fields the analysis reads (``ph cat name pid tid ts dur`` and ``args``' ``correlation``,
  ``External id``, ``In msg nelems``, ``dtype``, ``Collective name``); ``ts``/``dur`` as float
  microseconds (pnpscale keeps exact integer ns: this is a floor, not a replacement);
* ``pnpscale import``: ``python -c "import pnpscale.analysis.offline"`` (what ``pnpscale.analyze`` imports
  before it reads a trace: pandas, pyarrow; the fixed start-up cost inside the last line);
* ``pnpscale read_trace``: ``pnpscale.analysis.trace.read.read_trace`` of each file, in this process (the
  reader alone: the fast path's decompression, typed decoding and collection, then the kept events);
* ``pnpscale``: ``python -m pnpscale.analyze FILES --sections gradient,denoiser --jobs J --partial``.

Wall time is the command's, interpreter start included (a bare ``python -c pass`` is printed as the
zero). Peak memory: ``max RSS`` is the largest resident set of any one process of the command
(``wait4``'s ``ru_maxrss``, exact); ``peak PSS`` the largest sum of PSS over its process tree, sampled
every 0.05 s (what ``../shared/tools/htabench/side_by_side.py`` reports; a run shorter than the sampling
period reads low). The load average before and after is printed: the machine may be shared.

    python benchmarks/trace_floor.py --traces /tmp/t2x50 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trace_analysis_cost import tree_pss  # noqa: E402

SECTIONS = "gradient,denoiser"


def _decompressor(name: str) -> Callable[[bytes], bytes]:
    """``bytes -> bytes`` gzip decompression with ``name`` (``zlib``, ``isal``, ``zlib-ng``)."""
    if name == "isal":
        from isal import isal_zlib

        return lambda b: isal_zlib.decompress(b, 16 + 15)
    if name == "zlib-ng":
        from zlib_ng import zlib_ng

        return lambda b: zlib_ng.decompress(b, 16 + 15)
    import zlib

    return lambda b: zlib.decompress(b, 16 + 15)


def _gzip_size(path: str) -> int:
    """Uncompressed bytes of a one-member gzip file below 4 GiB (its ISIZE trailer, RFC 1952)."""
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little")


def _fastest() -> str:
    return "isal" if importlib.util.find_spec("isal") else "zlib-ng" if importlib.util.find_spec("zlib_ng") else "zlib"


def _msgspec_decoder() -> Any:
    """A ``msgspec.json.Decoder`` of a Kineto trace into structs of only the fields the analysis reads."""
    import msgspec

    args = msgspec.defstruct(
        "Args",
        [
            ("correlation", int | None, None),
            ("external_id", int | None, msgspec.field(default=None, name="External id")),
            ("in_nelems", int | None, msgspec.field(default=None, name="In msg nelems")),
            ("dtype", str | None, None),
            ("collective", str | None, msgspec.field(default=None, name="Collective name")),
        ],
    )
    ev = msgspec.defstruct(
        "Ev",
        [
            ("ph", str, ""),
            ("cat", str, ""),
            ("name", str, ""),
            ("pid", int | str, 0),
            ("tid", int | str, 0),
            ("ts", float, 0.0),
            ("dur", float, 0.0),
            ("args", args | None, None),
        ],  # fmt: skip
    )
    trace = msgspec.defstruct("Trace", [("traceEvents", list[ev])])
    return msgspec.json.Decoder(trace)


def worker(variant: str, files: list[str]) -> None:
    """Run one variant over ``files`` in this process; prints the number of events (or bytes) seen."""
    if variant in ("zlib", "isal", "zlib-ng"):
        dec = _decompressor(variant)
        n = sum(len(dec(Path(f).read_bytes())) for f in files)
        print(f"{n} bytes")
        return
    dec = _decompressor(_fastest())
    if variant == "orjson":
        import orjson

        n = sum(len(orjson.loads(dec(Path(f).read_bytes()))["traceEvents"]) for f in files)
    elif variant == "msgspec typed":
        decode = _msgspec_decoder().decode
        n = sum(len(decode(dec(Path(f).read_bytes())).traceEvents) for f in files)
    elif variant == "pnpscale read_trace":
        from pnpscale.analysis.trace.read import read_trace

        n = sum(len(read_trace(f, SECTIONS.split(",")).events) for f in files)
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    print(f"{n} events")


def run(cmd: list[str] | str) -> tuple[float, int, int, int, str]:
    """(wall s, max RSS bytes of one process, peak summed PSS bytes, return code, output tail) of ``cmd``."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, shell=isinstance(cmd, str))
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_pss(p.pid))
                time.sleep(0.05)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        th.join()
        out.seek(0)
        tail = out.read().decode(errors="replace")[-1500:]
    return wall, ru.ru_maxrss * 1024, peak[0], p.returncode, tail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, required=True, help="folder of *.json.gz traces, one per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="pnpscale's --jobs for the parallel run")
    a = p.parse_args()
    files = sorted(str(f) for f in a.traces.iterdir() if f.name.endswith(".json.gz"))
    if not files:
        raise SystemExit(f"no *.json.gz in {a.traces}")
    py, me = sys.executable, str(Path(__file__).resolve())
    decs = ["zlib"] + [d for d, mod in (("isal", "isal"), ("zlib-ng", "zlib_ng")) if importlib.util.find_spec(mod)]
    parsers = [v for v, mod in (("orjson", "orjson"), ("msgspec typed", "msgspec")) if importlib.util.find_spec(mod)]
    with tempfile.TemporaryDirectory() as tmp:

        def pnp(fs: list[str], jobs: int) -> list[str]:
            out = str(Path(tmp) / f"analysis-{len(fs)}-{jobs}")
            return [py, "-m", "pnpscale.analyze", *fs, "--sections", SECTIONS, "--jobs", str(jobs), "--partial",
                    "--out", out]  # fmt: skip

        cmds: dict[str, list[str] | str] = {}
        for scope, fs in (("1 rank", files[:1]), (f"{len(files)} ranks", files)):
            cmds[f"{scope}: python -c pass"] = [py, "-c", "pass"]
            if shutil.which("gzip"):
                cmds[f"{scope}: gzip CLI"] = " && ".join(f"gzip -dc '{f}' > /dev/null" for f in fs)
            for v in decs + parsers:
                cmds[f"{scope}: {v}"] = [py, me, "worker", v, *fs]
            cmds[f"{scope}: pnpscale import"] = [py, "-c", "import pnpscale.analysis.offline"]
            cmds[f"{scope}: pnpscale read_trace"] = [py, me, "worker", "pnpscale read_trace", *fs]
            cmds[f"{scope}: pnpscale --jobs 1"] = pnp(fs, 1)
            if len(fs) > 1 and a.jobs > 1:
                cmds[f"{scope}: pnpscale --jobs {a.jobs}"] = pnp(fs, a.jobs)
        raw = sum(_gzip_size(f) for f in files)  # not decompressed here: this process's RSS is the children's base
        disk = sum(Path(f).stat().st_size for f in files)
        print(f"{len(files)} traces in {a.traces}: {disk / 1e6:.1f} MB gzip, {raw / 1e6:.1f} MB JSON; "
              f"{os.cpu_count()} CPUs; fastest decompressor here: {_fastest()}")  # fmt: skip
        print(f"load average before: {os.getloadavg()}", flush=True)
        res: dict[str, list[tuple[float, int, int]]] = {k: [] for k in cmds}
        for r in range(a.rounds):
            for label, cmd in cmds.items():
                wall, rss, pss, rc, tail = run(cmd)
                if rc:
                    print(tail)
                    raise SystemExit(f"{label} failed (rc {rc})")
                res[label].append((wall, rss, pss))
                print(f"round {r} {label:28s} {wall:7.2f} s  max RSS {rss / 1e6:7.1f} MB  PSS {pss / 1e6:7.1f} MB",
                      flush=True)  # fmt: skip
        print(f"load average after: {os.getloadavg()}")
    print("\n| command | median wall | median x floor (per round) | max RSS | peak PSS |\n|---|---:|---:|---:|---:|")
    for scope in ("1 rank", f"{len(files)} ranks"):
        floor_key = f"{scope}: msgspec typed" if "msgspec typed" in parsers else f"{scope}: {decs[-1]}"
        for label, xs in res.items():
            if not label.startswith(scope + ":"):
                continue
            w = statistics.median(x[0] for x in xs)
            ratio = statistics.median(x[0] / f[0] for x, f in zip(xs, res[floor_key], strict=True))
            rss = statistics.median(x[1] for x in xs)
            pss = statistics.median(x[2] for x in xs)
            print(f"| {label} | {w:.2f} s | {ratio:.2f} | {rss / 1e6:.0f} MB | {pss / 1e6:.0f} MB |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
