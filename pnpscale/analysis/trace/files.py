"""The bytes of a Kineto trace file: opening (gzip by content), the head before ``traceEvents``, the keys
written after the events, bare non-finite tokens (found, and repaired while streaming), exact numbers.

Shared by the two passes over a file (:mod:`pnpscale.analysis.trace.scan`) and the facade
(:mod:`pnpscale.analysis.trace.read`). Pure reading: no event is interpreted here.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from collections.abc import Mapping
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any, BinaryIO, cast

from pnpscale.core.errors import PnpscaleError

#: top-level keys of a trace besides ``traceEvents`` that pnpscale reads, wherever they sit in the file
_META_KEYS = ("distributedInfo", "deviceProperties", "baseTimeNanoseconds")
#: bare non-finite number tokens Kineto writes (not JSON), as values: after ``:``/``,``/``[``
_NON_FINITE = re.compile(rb"(?<=[:,\[])(\s*)(-?(?:Infinity|inf|NaN|nan))(?=\s*[,\]}])")
_HEAD_START = 1 << 18
HEAD_MAX = 1 << 26
TAIL = 1 << 16
CHUNK = 1 << 16


class TraceError(PnpscaleError, ValueError):
    """A trace that cannot be read (missing, not gzip/JSON, no event list)."""


class NotATraceError(TraceError):
    """A readable JSON file that is not a Kineto trace (no ``traceEvents``): skipped in folders."""


class Fallback(Exception):
    """The fast path met a layout it does not read exactly: the file is read again by the exact ``ijson`` pass."""


def refuse_constant(token: str) -> Any:
    raise Fallback(f"non-finite token {token}")


def closes_json(path: Path) -> bool:
    """Whether the (decompressed) file's last non-blank byte closes a JSON object or array (``}`` or ``]``): a
    file cut short mostly does not. Unreadable files count as not closed."""
    last = b""
    try:
        with open_trace_file(path) as raw:
            while chunk := raw.read(1 << 20):
                if chunk.strip():
                    last = chunk.rstrip()[-1:]
    except (OSError, EOFError, zlib.error, TraceError):
        return False
    return last in (b"}", b"]")


def valid_object(text: str) -> bool:
    import json

    try:
        return isinstance(json.loads(text, parse_constant=refuse_constant), dict)
    except (ValueError, Fallback):
        return False


def non_finite_tokens(path: Path) -> list[tuple[str, int]]:
    """Every bare ``inf``/``NaN``/``Infinity`` value token in the (decompressed) file, with its byte offset."""
    out: list[tuple[str, int]] = []
    done = 0  # offset of carry[0] (the last byte of the previous part, kept for the look-behind)
    carry = b""
    with open_trace_file(path) as raw:
        while True:
            chunk = raw.read(1 << 22)
            text = carry + chunk
            cut = len(text) if not chunk else max(text.rfind(b","), text.rfind(b"]"), text.rfind(b"}")) + 1
            for m in _NON_FINITE.finditer(text[:cut]):
                out.append((m.group(2).decode(), done + m.start(2)))
            if not chunk:
                return out
            start = max(cut - 1, 0)
            done += start
            carry = text[start:]


def meta_from_tail(tail: bytes) -> dict[str, Any]:
    """The top-level keys of :data:`_META_KEYS` written after ``traceEvents`` (found in the file's last bytes)."""
    import json

    text = tail.decode("utf-8", errors="replace")
    out: dict[str, Any] = {}
    dec = json.JSONDecoder()
    for key in _META_KEYS:
        for m in reversed(list(re.finditer(rf'"{key}"\s*:\s*', text))):
            try:
                out[key] = dec.raw_decode(text, m.end())[0]
                break
            except ValueError:
                continue
    return out


# --- reading ---------------------------------------------------------------------------------


def open_trace_file(path: Path) -> BinaryIO:
    """The file's bytes: decompressed when it starts with the gzip magic number."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        return cast(BinaryIO, gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb"))  # noqa: SIM115
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from exc


def read_head(path: Path, raw: BinaryIO) -> tuple[dict[str, Any], bytes, bool]:
    """Top-level keys before ``traceEvents``; the bytes read so far; whether the top is an array."""
    head = b""
    size = _HEAD_START
    while True:
        try:
            chunk = raw.read(size - len(head))
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(f"{path}: cannot read trace: {first_line(exc)}") from exc
        head += chunk
        start = head.lstrip()[:1]
        if start == b"[":
            return {}, head, True
        if head.strip() and start != b"{":
            raise NotATraceError(f"{path}: not a JSON trace (starts with {head.lstrip()[:20]!r})")
        meta, complete = _parse_head(head)
        if complete or not chunk or len(head) >= HEAD_MAX:
            if not head.strip():
                raise TraceError(f"{path}: empty file")
            return meta, head, False
        size = min(2 * size, HEAD_MAX)


def _parse_head(head: bytes) -> tuple[dict[str, Any], bool]:
    """Top-level values of the object in ``head`` up to ``traceEvents`` (True when reached)."""
    import ijson

    meta: dict[str, Any] = {}
    key, builder, depth = None, None, 0
    try:
        for prefix, event, value in ijson.parse(io.BytesIO(head), use_float=False):
            if builder is None:
                if prefix == "" and event == "map_key":
                    if value == "traceEvents":
                        meta["traceEvents"] = True
                        return meta, True
                    key, builder, depth = value, ijson.ObjectBuilder(), 0
                continue
            builder.event(event, value)
            depth += event in ("start_map", "start_array")
            depth -= event in ("end_map", "end_array")
            if depth == 0:
                meta[key] = builder.value  # type: ignore[index]
                builder = None
    except ijson.IncompleteJSONError:
        return meta, False
    except ijson.JSONError as exc:
        raise ValueError(f"invalid JSON: {first_line(exc)}") from exc
    return meta, True


class Replay(io.RawIOBase):
    """Binary stream: ``head`` then the rest of ``raw``; remembers the last bytes read and the offset.

    With ``repair``, bare non-finite value tokens (``inf``, ``-inf``, ``NaN``, ``Infinity``) are
    replaced by ``null``; the text is cut after the last ``,``/``]``/``}`` of each chunk so that no
    token is split.
    """

    def __init__(self, head: bytes, raw: BinaryIO, repair: bool = False) -> None:
        self._head = memoryview(head)
        self._raw = raw
        self.tail = bytearray()
        self.offset = 0
        self._repair = repair
        self._carry = b""
        self._prev = b""
        self._out = b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = CHUNK if n is None or n < 0 else n
        if not self._repair:
            return self._read(n)
        while len(self._out) < n:
            data = self._read(n)
            if not data:
                self._out += self._fix(self._carry)
                self._carry = b""
                break
            text = self._carry + data
            cut = max(text.rfind(b","), text.rfind(b"]"), text.rfind(b"}")) + 1
            self._out += self._fix(text[:cut])
            self._carry = text[cut:]
        out, self._out = self._out[:n], self._out[n:]
        return out

    def _fix(self, text: bytes) -> bytes:
        if not text:
            return text
        fixed = _NON_FINITE.sub(rb"\1null", self._prev + text)[len(self._prev) :]
        self._prev = text[-1:]
        return fixed

    def _read(self, n: int) -> bytes:
        if len(self._head):
            data, self._head = bytes(self._head[:n]), self._head[n:]
        else:
            data = self._raw.read(n)
        if data:
            self.offset += len(data)
            self.tail += data
            if len(self.tail) > 2 * TAIL:
                del self.tail[: len(self.tail) - TAIL]
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


def json_error() -> type[Exception]:
    import ijson

    return ijson.JSONError


#: timestamps beyond this many ns (about 73 years either side of the epoch) are not times
NS_RANGE = 1 << 61


def ts_text(ev: Mapping[str, Any]) -> str:
    """An event's ``ts`` as written (for messages)."""
    return str(ev.get("ts"))


def to_ns(x: Any) -> int:
    """Microseconds (int, Decimal, float or str) -> integer nanoseconds, exactly for decimals."""
    if isinstance(x, int):
        return x * 1000
    if isinstance(x, Decimal):
        return int((x * 1000).to_integral_value(ROUND_HALF_EVEN))
    if isinstance(x, float):
        return round(x * 1000)
    return int((Decimal(str(x)) * 1000).to_integral_value(ROUND_HALF_EVEN))


def ns_text(t: bytes) -> int:
    """A JSON number literal (``-?digits[.digits]``, microseconds) -> integer ns, exactly (as :func:`to_ns`)."""
    i = t.find(b".")
    if i < 0:
        return int(t) * 1000
    frac = t[i + 1 :]
    if len(frac) > 3:
        return to_ns(Decimal(t.decode()))
    whole, f = int(t[:i]) * 1000, int(frac.ljust(3, b"0"))
    return whole - f if t[:1] == b"-" else whole + f
