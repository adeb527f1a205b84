"""Runs tests/test_sharding.py in a process of its own with 8 fake CPU devices (the rest of the suite
keeps conftest's 2; see the note at the top of test_sharding.py)."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

EIGHT = "--xla_force_host_platform_device_count=8"


@pytest.mark.skipif(jax.device_count() == 8, reason="already on 8 devices: test_sharding.py runs here")
def test_mesh_tests_on_8_devices():
    here = pathlib.Path(__file__).parent
    env = dict(os.environ, XLA_FLAGS=EIGHT)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           str(here / "test_sharding.py")], cwd=here.parent, env=env, capture_output=True,
                          text=True, timeout=3000)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
