"""One memory report for every host (Engine and bench, scheduler, server, mesh): what each part's
arrays hold, what the compiled programs hold, what the process measured, and what is left over.

A `Report` has:
- `parts`: bytes per device of each part's arrays, in `PARTS` order: `weights` (the target's),
  `draft_weights` (a draft model, heads, an EAGLE head: proposer parameters the target does not
  hold), `caches` (the batch's decode state, KV caches first, and the proposers' states), then each
  batch-shared state by name (`ngram_table`). Live arrays are read as the runtime allocated them
  (`on_device_size_in_bytes` of each shard, padding included), each device buffer counted once, in
  the first part that holds it (Medusa's LM head is the target's: weights); a plan (`planned`)
  gives the same parts from shapes alone, before anything is allocated.
- `programs`: the compiled programs kept (`count`), the temporaries they allocate while they run
  (`temp_bytes`, summed: the largest is what a run needs at once) and what compiling them added to
  the process (`rss_bytes`: XLA's CPU code and the compiler's heap, measured around each compile).
- `measured`: the process's resident set now and at its peak (`rss_bytes`, `peak_rss_bytes`, Linux:
  since `reset_peak`), and the device's bytes in use and peak where the backend reports them.
- `other_bytes`: on CPU, where the arrays live in the process, the resident set less the arrays
  and the programs: the allocator's free pages, host copies, the runtime.

`report` reads a host's live arrays; `measure` is the measured half alone (a server's gauges);
`markdown` is the table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

PARTS = ("weights", "draft_weights", "caches")  # then the batch-shared states, by name


@dataclasses.dataclass(frozen=True)
class Report:
    """Bytes per device of each part, the compiled programs, and what was measured (see the module)."""

    parts: dict[str, int]
    programs: dict[str, int] = dataclasses.field(default_factory=dict)
    measured: dict[str, int] = dataclasses.field(default_factory=dict)
    devices: int = 1
    mesh: str | None = None  # the mesh's shape, for a plan on one (`specjax.sharding.describe`)

    @property
    def arrays_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def other_bytes(self) -> int | None:
        """The resident set less the arrays and the programs (None where arrays live on a device)."""
        if "rss_bytes" not in self.measured or "device_bytes_in_use" in self.measured:
            return None
        return self.measured["rss_bytes"] - self.arrays_bytes - self.programs.get("rss_bytes", 0)

    def to_dict(self) -> dict[str, int | None]:
        """Flat: `<part>_bytes`, `arrays_bytes`, `program_<x>`, the measured keys, `other_bytes`."""
        return {**{f"{k}_bytes": v for k, v in self.parts.items()}, "arrays_bytes": self.arrays_bytes,
                **{f"program_{k}": v for k, v in self.programs.items()}, **self.measured,
                "other_bytes": self.other_bytes}


def _shards(x) -> Iterable[tuple[tuple[int, int], int, int]]:
    """((device, buffer) key, device id, allocated bytes) of each addressable shard of a live array."""
    for s in x.addressable_shards:
        d = s.data
        yield (s.device.id, d.unsafe_buffer_pointer()), s.device.id, int(d.on_device_size_in_bytes())


def part_bytes(parts: Mapping[str, Any]) -> tuple[dict[str, int], int]:
    """Allocated bytes per device of each part's live arrays (the largest device's), each device
    buffer counted once, in the first part that holds it; and the number of devices seen. Arrays
    already donated (deleted) are skipped: call it between steps, from the thread that steps."""
    import jax

    seen: set = set()
    out, devices = {}, set()
    for name, tree in parts.items():
        per_device: dict[int, int] = {}
        for x in jax.tree.leaves(tree):
            if not isinstance(x, jax.Array) or x.is_deleted():
                continue
            for key, dev, n in _shards(x):
                if key not in seen:
                    seen.add(key)
                    per_device[dev] = per_device.get(dev, 0) + n
        devices |= set(per_device)
        out[name] = max(per_device.values(), default=0)
    return out, max(1, len(devices))


def program_stats(compiled: Iterable[Any], rss_bytes: int = 0) -> dict[str, int]:
    """`count` and summed `temp_bytes` of compiled executables (`memory_analysis`), with what
    compiling them added to the resident set (`rss_bytes`, as measured by whoever compiled)."""
    count, temp = 0, 0
    for c in compiled:
        count += 1
        try:
            temp += int(c.memory_analysis().temp_size_in_bytes)
        except Exception:  # a backend without the analysis
            pass
    return dict(count=count, temp_bytes=temp, rss_bytes=int(rss_bytes))


def rss_bytes() -> int:
    """The process's resident set now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure() -> dict[str, int]:
    """Measured now: `rss_bytes` and `peak_rss_bytes` of the process; where the backend reports them
    (GPU, TPU), `device_bytes_in_use` and `device_peak_bytes` (the largest local device's)."""
    import jax

    out = dict(rss_bytes=rss_bytes(), peak_rss_bytes=_peak_rss_bytes())
    stats = [s for s in (_stats(d) for d in jax.local_devices()) if s]
    if any("bytes_in_use" in s or "peak_bytes_in_use" in s for s in stats):
        out["device_bytes_in_use"] = max(int(s.get("bytes_in_use", 0)) for s in stats)
        out["device_peak_bytes"] = max(int(s.get("peak_bytes_in_use", 0)) for s in stats)
    return out


def _stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # backends without the call raise rather than return None
        return None


def added(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """What happened between two `measure`s, per key both have."""
    return {k: after[k] - before[k] for k in after if k in before}


def report(parts: Mapping[str, Any], *, programs: Iterable[Any] = (), program_rss_bytes: int = 0,
           measured: bool = True) -> Report:
    """The report of live arrays by part (`PARTS` first), the compiled `programs` and, with
    `measured`, the process now."""
    by_part, devices = part_bytes(parts)
    return Report(parts=by_part, programs=program_stats(programs, program_rss_bytes),
                  measured=measure() if measured else {}, devices=devices)


def planned(parts: Mapping[str, int], *, devices: int = 1, mesh: str | None = None) -> Report:
    """A report from bytes per device computed from shapes (a plan: nothing allocated, nothing
    measured)."""
    return Report(parts=dict(parts), devices=devices, mesh=mesh)


def reset_peak() -> bool:
    """Starts a new span for the resident peak where the platform allows it: on Linux, the process's
    high-water mark is reset (`/proc/self/clear_refs`). A device's peak cannot be reset from JAX:
    it stays the peak since the process started. Returns whether the reset happened."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak() -> dict:
    """The measured peak as `peak_mem_bytes` and `peak_mem_source`: the largest local device's
    `peak_bytes_in_use` where the backend keeps statistics ("device"); elsewhere (CPU, where the
    arrays live in host memory) the process's peak resident set ("rss"), since the last
    `reset_peak` or the process's start. Unlike a sum of array sizes, it includes XLA's temporaries
    and everything else the process holds."""
    m = measure()
    if "device_peak_bytes" in m:
        return dict(peak_mem_bytes=m["device_peak_bytes"], peak_mem_source="device")
    return dict(peak_mem_bytes=m["peak_rss_bytes"], peak_mem_source="rss")


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024  # bytes on macOS, KiB elsewhere


def markdown(rows: Mapping[str, Report]) -> str:
    """The memory table: one row per labelled report, the parts (every part any report has), the
    arrays' sum, the programs, what was measured and what is left over, in MiB."""
    parts = list(dict.fromkeys(p for r in rows.values() for p in r.parts))
    mib = lambda x: "" if x is None else f"{x / 2**20:.1f}"
    head = ["", *parts, "arrays", "programs (n / temp / rss added)", "rss now / peak", "other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in rows.items():
        pr, m = r.programs, r.measured
        progs = f"{pr.get('count', 0)} / {mib(pr.get('temp_bytes'))} / {mib(pr.get('rss_bytes'))}" if pr else ""
        rss = f"{mib(m.get('rss_bytes'))} / {mib(m.get('peak_rss_bytes'))}" if m else ""
        cells = [label, *(mib(r.parts.get(p)) for p in parts), mib(r.arrays_bytes), progs, rss, mib(r.other_bytes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nMiB per device; programs: compiled programs kept, their temporaries, and what " \
                              "compiling them added to the resident set; other: resident set less arrays and programs."
