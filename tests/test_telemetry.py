"""`telemetry.peak_memory`: measured, from the device's statistics or the process's resident peak."""

import mmap
import sys

import jax
import numpy as np
import pytest

from specjax import telemetry


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
    assert telemetry.peak_memory() == dict(peak_mem_bytes=900, peak_mem_source="device")


@pytest.mark.parametrize("stats", [None, {}, NotImplementedError("no stats on this backend")])
def test_without_device_statistics_it_is_the_resident_peak(monkeypatch, stats):
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(stats)])
    m = telemetry.peak_memory()
    assert m["peak_mem_source"] == "rss" and m["peak_mem_bytes"] > 10 * 2**20  # the interpreter alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident peak resets on Linux only")
def test_the_resident_peak_is_measured_and_resets():
    assert jax.devices()[0].memory_stats() is None  # CPU: the host's resident set is the measure
    assert telemetry.reset_peak_memory()
    before = telemetry.peak_memory()["peak_mem_bytes"]
    # 64 MiB of fresh pages, touched: an anonymous mapping of its own (an np.ones could reuse freed
    # pages the allocator still holds resident in a long-lived test process, and not grow the RSS)
    big = mmap.mmap(-1, 64 * 2**20)
    np.frombuffer(big, np.uint8)[:] = 1
    grown = telemetry.peak_memory()["peak_mem_bytes"]
    assert grown >= before + 60 * 2**20
    big.close()
    assert telemetry.reset_peak_memory()
    assert telemetry.peak_memory()["peak_mem_bytes"] < grown - 60 * 2**20  # the freed 64 MiB left the peak
