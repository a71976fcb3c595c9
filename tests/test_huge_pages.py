"""Weight buffers on 2 MB pages (model/native/huge_pages.py): from 2 MB on a CPU buffer
starts at a 2 MB boundary with the kernel's advice taken and holds what is written to it;
smaller or non-CPU ones are plain."""

import platform
from pathlib import Path

import pytest
import torch

from model.native.huge_pages import HUGE_PAGE, advise_huge_pages, empty_on_huge_pages


def _thp_enabled() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise is Linux's")
def test_a_large_buffer_starts_on_a_huge_page_and_holds_its_values() -> None:
    t = empty_on_huge_pages((3, HUGE_PAGE // 2 + 8), torch.float16, "cpu")
    assert t.shape == (3, HUGE_PAGE // 2 + 8) and t.dtype == torch.float16
    assert t.data_ptr() % HUGE_PAGE == 0 and t.is_contiguous()
    values = torch.randn(t.shape).half()
    t.copy_(values)
    assert torch.equal(t, values)
    if _thp_enabled():
        assert advise_huge_pages(t)


def test_small_and_meta_buffers_are_plain() -> None:
    small = empty_on_huge_pages((16, 32), torch.uint8, "cpu")
    assert small.shape == (16, 32) and small.untyped_storage().nbytes() == 16 * 32
    meta = empty_on_huge_pages((4096, 4096), torch.int8, "meta")
    assert meta.device.type == "meta" and meta.shape == (4096, 4096)


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise is Linux's")
def test_packed_int4_int5_and_int6_weights_start_on_huge_pages() -> None:
    """The packed copies are what a decode step streams: the staging buffers' 2 MB pages
    are left behind when packing writes the tiles elsewhere."""
    from model.native.ops import NativeInt4Matmul, NativeInt5Matmul, NativeInt6Matmul

    out_features, in_features = 4096, 8192  # 16 MB of int4 and 4 MB of its scales
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    scales = torch.rand(in_features // 32, out_features, 2).to(torch.bfloat16)
    int4, int4_scales = NativeInt4Matmul.pack(q, scales)
    int5, _ = NativeInt5Matmul().pack(q * 2, torch.rand(out_features, in_features // 32))
    int6, _ = NativeInt6Matmul().pack(
        q * 4,
        torch.randint(-8, 8, (out_features, in_features // 16), dtype=torch.int8),
        torch.rand(out_features, in_features // 256),
    )
    from model.quant.int6 import Int6Linear

    layer_bytes = Int6Linear(in_features, out_features, "cpu")._new_staging()  # filled as rows load
    for weight in (int4, int4_scales, int5, int6, layer_bytes):
        assert weight.data_ptr() % HUGE_PAGE == 0
