"""Live torch.profiler session and its events as plain :class:`~pnpscale.analysis.events.Event` records.

One profiler session covers every iteration (``prof.step()`` after each), as recommended for
kernels not to be dropped or shifted between sessions; events are read in process from the
Kineto results (no JSON round trip). Section ranges are ``record_function`` ranges; on CUDA each
section ends with ``torch.cuda.synchronize()`` inside its range so that all GPU work of a section
is launched and finished inside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pnpscale.analysis.events import Event, Kind, collective_type, payload_bytes

_GPU_ACTIVITIES = {"kernel", "gpu_memcpy", "gpu_memset", "concurrent_kernel"}
_RUNTIME_ACTIVITIES = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
_SKIP_ACTIVITIES = {"gpu_user_annotation", "overhead", "python_function", "cuda_sync"}


def make_profiler(cuda: bool, record_shapes: bool) -> profile:
    """A profiler over CPU (and CUDA when ``cuda``) activity, recording input shapes.

    ``record_shapes`` must stay on for payload bytes (collective sizes come from input shapes).
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities, record_shapes=record_shapes)


def profiler_events(prof: profile) -> list[Event]:
    """Convert a finished profiler session's Kineto events to :class:`Event` records.

    Raises:
        RuntimeError: the profiler has no results (it was not run).
    """
    results = getattr(prof.profiler, "kineto_results", None) if prof.profiler else None
    if results is None:
        raise RuntimeError("the profiler has no results: was the profiling context exited?")
    raw = list(results.events())
    runtime_start: dict[int, int] = {}
    for e in raw:
        if e.activity_type() in _RUNTIME_ACTIVITIES:
            runtime_start[e.correlation_id()] = e.start_ns()
    out: list[Event] = []
    for e in raw:
        act = e.activity_type()
        if act in _SKIP_ACTIVITIES:
            continue
        start = int(e.start_ns())
        end = start + int(e.duration_ns())
        name = e.name()
        if act in _GPU_ACTIVITIES or str(e.device_type()) == "DeviceType.CUDA":
            corr = int(e.correlation_id())
            out.append(
                Event(
                    name,
                    Kind.GPU,
                    start,
                    end,
                    tid=int(e.device_resource_id()),
                    correlation=corr,
                    launch_ns=runtime_start.get(corr),
                )
            )
        elif act in _RUNTIME_ACTIVITIES:
            out.append(
                Event(name, Kind.RUNTIME, start, end, tid=int(e.start_thread_id()), correlation=int(e.correlation_id()))
            )
        else:
            is_comm = name.startswith(("gloo:", "nccl:"))
            out.append(
                Event(
                    name,
                    Kind.CPU,
                    start,
                    end,
                    tid=int(e.start_thread_id()),
                    payload_bytes=payload_bytes(e.shapes(), e.dtypes()) if is_comm else None,
                    collective=collective_type(name) if is_comm else None,
                )
            )
    return out


def export_trace(prof: profile, path: Path) -> None:
    """Write the Kineto trace (Chrome/Perfetto/HTA-readable JSON) atomically to ``path``."""
    from pnpscale import layout

    with layout.atomic_path(path) as tmp:
        prof.export_chrome_trace(str(tmp))


class PeakMemory:
    """Peak memory of this process over a section, in bytes.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the
    resident-set high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs`` (Linux);
    where it cannot be reset the value is the process's peak so far (``ru_maxrss``).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.resettable = self.cuda or _clear_refs()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _clear_refs()

    def peak_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _vm_hwm_bytes()
        if hwm is not None:
            return hwm
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    @contextmanager
    def track(self) -> Iterator[list[int]]:
        """``with peak.track() as box: ...`` leaves the peak in ``box[0]``."""
        box: list[int] = [0]
        self.reset()
        try:
            yield box
        finally:
            box[0] = self.peak_bytes()


def _clear_refs() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
