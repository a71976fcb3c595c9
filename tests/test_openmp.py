"""Releasing a thread's OpenMP team (scheduler/runner/openmp.py): the workers must really
exit, counted in /proc, in a process of its own so no other test's threads interfere."""

import subprocess
import sys

import pytest

SCRIPT = """
import os, threading, torch
from scheduler.runner.openmp import loaded_openmp_runtime, release_openmp_workers

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
before = threads()
torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel region starts this thread's team
with_team = threads()
released = release_openmp_workers()
print(loaded_openmp_runtime() is not None, before, with_team, released, threads())
"""


def test_release_ends_the_calling_threads_openmp_workers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    has_runtime, before, with_team, released, after = out
    if has_runtime != "True":
        pytest.skip("this torch build does not use libgomp")
    assert int(with_team) > int(before), "the matrix product started no OpenMP worker"
    assert released == "True"
    assert int(after) == int(before)
