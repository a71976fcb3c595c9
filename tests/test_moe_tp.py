"""-tp 2 on the mixture-of-experts families equals -tp 1 within 1e-4 (real torch.distributed
ranks over gloo, tests/tp_forward.py): each expert's FFN rows split across the ranks, the
router held whole, OLMoE's whole-projection Q/K norms split with their heads; from
safetensors and from a GGUF's stacked expert tensors, in one start-up of the ranks."""

import torch

from tests.test_tensor_parallel import TOL, one_process, run_ranks
from tests.tiny_families import make_tiny, write_gguf


def test_tp2_logits_match_one_process(tmp_path) -> None:
    paths = []
    for family in ("qwen3_moe", "olmoe", "mixtral"):
        directory = tmp_path / family
        hf = make_tiny(family, directory)
        paths += [str(directory), str(write_gguf(hf, family, directory, directory / "t.gguf"))]
    split = run_ranks(",".join(paths), 2, tmp_path / "tp2.pt")
    for path, logits in zip(paths, split, strict=True):
        single = one_process(path)
        for a, b in zip(logits, single, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=path)
