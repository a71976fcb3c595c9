"""`return_free_heap` really hands freed heap memory back: RSS counted in /proc, in a
process of its own."""

import subprocess
import sys

SCRIPT = """
import re
from model.heap import return_free_heap

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

chunks = [bytearray(64 * 1024) for _ in range(3000)]  # below mmap's threshold: the heap
del chunks[:-1]  # everything but the last, so the heap's top stays in use
before = rss()
released = return_free_heap()
print(released, before - rss())
"""


def test_freed_heap_memory_leaves_the_process() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    released, dropped = out[0] == "True", int(out[1])
    assert released
    assert dropped > 100 * 2**20, f"RSS fell by only {dropped} bytes"
