"""Whether AMX code built by this machine's C compiler runs, which decides how llama-server
is built for it.

On a 2-core Intel Xeon listing `amx_bf16 amx_int8 amx_tile`, llama.cpp's own build for the
CPU (`GGML_NATIVE`) died with SIGILL on its first matrix product, in
`tinygemm_kernel_amx`, while PyTorch's prebuilt oneDNN ran AMX products on the same
machine. Debian 12's GCC 12.2 at -O1 and above drops the stores that fill a tile
configuration before `_tile_loadconfig` reads it, so the first tile instruction meets an
unconfigured tile. The probe is that pattern (a configuration filled in C, loaded, a tile
zeroed), built by the same compiler with optimisation and run in a child process; where
it faults, the peer is built without AMX and keeps the rest of `-march=native`.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

# Flags for the C and C++ compilers that keep `-march=native` whole but AMX: explicit
# -mno-* options win over -march wherever they stand.
WITHOUT_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* tile data */))
        return 2;
    unsigned char config[64] = {0};
    config[0] = 1;   /* palette 1 */
    config[16] = 64; /* tile 0: 64 bytes a row */
    config[48] = 16; /* and 16 rows */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def cpu_lists_amx() -> bool:
    return " amx_tile" in Path("/proc/cpuinfo").read_text()


@cache
def amx_runs() -> bool:
    """True where the probe runs; False where it faults, or where no compiler can build
    it (llama.cpp's build then needs one too)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "amx.c", Path(tmp) / "amx"
        source.write_text(PROBE)
        built = subprocess.run(
            [compiler, "-O1", "-mamx-tile", "-o", str(binary), str(source)], capture_output=True
        )
        if built.returncode != 0:
            return False
        return subprocess.run([str(binary)], capture_output=True).returncode == 0


def amx_faults() -> bool:
    """The CPU lists AMX, yet AMX code this compiler builds does not run."""
    return cpu_lists_amx() and not amx_runs()
