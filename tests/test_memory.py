"""`specjax.memory`: the one memory report. Arrays by part, each device buffer counted once; the peak
measured from the device's statistics or the process's resident peak; what the rest of the resident
set holds."""

import mmap
import sys

import jax
import numpy as np
import pytest

from specjax import memory


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_device_statistics_win_where_the_backend_has_them(monkeypatch):
    devices = [_Device({"bytes_in_use": 5, "peak_bytes_in_use": 700}), _Device({"peak_bytes_in_use": 900})]
    monkeypatch.setattr(jax, "local_devices", lambda: devices)
    assert memory.peak() == dict(peak_mem_bytes=900, peak_mem_source="device")


@pytest.mark.parametrize("stats", [None, {}, NotImplementedError("no stats on this backend")])
def test_without_device_statistics_it_is_the_resident_peak(monkeypatch, stats):
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(stats)])
    m = memory.peak()
    assert m["peak_mem_source"] == "rss" and m["peak_mem_bytes"] > 10 * 2**20  # the interpreter alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident peak resets on Linux only")
def test_the_resident_peak_is_measured_and_resets():
    assert jax.devices()[0].memory_stats() is None  # CPU: the host's resident set is the measure
    assert memory.reset_peak()
    before = memory.peak()["peak_mem_bytes"]
    # 64 MiB of fresh pages, touched: an anonymous mapping of its own (an np.ones could reuse freed
    # pages the allocator still holds resident in a long-lived test process, and not grow the RSS)
    big = mmap.mmap(-1, 64 * 2**20)
    np.frombuffer(big, np.uint8)[:] = 1
    grown = memory.peak()["peak_mem_bytes"]
    assert grown >= before + 60 * 2**20
    big.close()
    assert memory.reset_peak()
    assert memory.peak()["peak_mem_bytes"] < grown - 60 * 2**20  # the freed 64 MiB left the peak


def test_each_buffer_counts_once_in_the_first_part_that_holds_it():
    import jax.numpy as jnp

    w, head, cache = jnp.ones((64, 32)), jnp.ones((32, 8)), jnp.zeros((4, 16), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 4)  # typed keys count by their data
    gone = jnp.ones(1000)
    gone.delete()  # a donated buffer: skipped
    by_part, devices = memory.part_bytes(dict(weights={"w": w, "head": head}, draft_weights=[head, w],
                                              caches=(cache, keys, gone)))
    assert by_part == dict(weights=64 * 32 * 4 + 32 * 8 * 4, draft_weights=0,
                           caches=4 * 16 * 4 + jax.random.key_data(keys).nbytes) and devices == 1


def test_the_report_and_its_table():
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x.T))
    prog = f.lower(jnp.ones((64, 64))).compile()
    r = memory.report(dict(weights=jnp.ones((256, 256)), caches=()), programs=[prog], program_rss_bytes=123)
    assert r.parts == dict(weights=256 * 256 * 4, caches=0) and r.arrays_bytes == 256 * 256 * 4
    assert r.programs == dict(count=1, temp_bytes=prog.memory_analysis().temp_size_in_bytes, rss_bytes=123)
    assert r.measured["rss_bytes"] > r.arrays_bytes and r.measured["peak_rss_bytes"] >= r.measured["rss_bytes"]
    assert r.other_bytes == r.measured["rss_bytes"] - r.arrays_bytes - 123  # CPU: the rest of the resident set
    flat = r.to_dict()
    assert flat["weights_bytes"] == r.parts["weights"] and flat["program_count"] == 1
    assert memory.Report(**__import__("dataclasses").asdict(r)) == r  # a JSON-able dict round trip
    table = memory.markdown({"plain": r, "plan": memory.planned(dict(weights=2**20, caches=2**21))})
    assert "| plain | 0.2 | 0.0 | 0.2 | 1 / " in table and "| plan | 1.0 | 2.0 | 3.0 |  |  |  |" in table
