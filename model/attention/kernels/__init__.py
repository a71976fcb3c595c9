"""Triton kernels of the `triton_paged` attention backend, each beside its plain-PyTorch
twin (the same function written the obvious way) that tests hold it to.

On a machine without a GPU the same kernel source runs on CPU tensors under Triton's
interpreter (`TRITON_INTERPRET=1`, set before triton is imported): slow, but it executes
every index, mask and reduction the GPU would, which is how CI proves the kernels."""

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# tl.dot needs every dimension of at least 16 on the GPU; smaller tiles are padded and masked.
MIN_DOT = 16
