"""Whether AMX's tile instructions run on this machine, which decides how llama-server is
built for it.

Some virtual machines list `amx_tile` among the CPU's flags, and the kernel grants a
process the tile state, yet the first tile instruction raises SIGILL: llama.cpp's own build
for such a CPU (`GGML_NATIVE`) then dies on its first matrix product (seen on a 2-core
Intel Xeon with `amx_bf16 amx_int8 amx_tile`, in `tinygemm_kernel_amx`). The probe is a
few lines of C that ask for the tile state and load a tile configuration, run in a child
process; a peer built where it fails leaves AMX out and keeps the rest of `-march=native`.
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
    """True where the probe's tile instructions run; False where they fault, or where no
    compiler can build the probe (llama.cpp's build then needs one too)."""
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
    """The CPU lists AMX, yet its tile instructions do not run here."""
    return cpu_lists_amx() and not amx_runs()
