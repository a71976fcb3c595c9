"""A draft model guesses among the first `draft_vocab_size` token ids only
(scheduler/runner/draft_model.py): its logits over them must be exactly the first columns
of its whole logits, whatever its output projection is stored in: a packed one (grouped
int8, int6) reads its first tiles, each column summed as in the whole product, bit for
bit; a float one multiplies by its first rows (PyTorch may block a narrower product
otherwise: within bf16's rounding)."""

import os
import shutil

import pytest
import torch

from model.config import ModelConfig
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from model.quant.int6 import Int6Linear
from model.quant.int8_group import Int8GroupLinear
from model.random_model import random_llama

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)

# 256 wide: int6's super-blocks; a vocabulary of whole tiles of 16 ids.
CONFIG = ModelConfig(
    dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=1008
)


def model_with_head(head: str):
    model = random_llama(CONFIG, dtype=torch.bfloat16, std=0.05)
    if head != "float":
        packed = (
            Int8GroupLinear(CONFIG.dim, CONFIG.vocab_size, "cpu")
            if head == "int8g"
            else Int6Linear(CONFIG.dim, CONFIG.vocab_size, "cpu", logits=True)
        )
        packed.load_rows(0, model.lm_head.weight.float())
        model.lm_head = packed
    return model


@pytest.mark.parametrize("head", ["float", "int8g", "int6"])
def test_the_first_logits_are_the_whole_head_s_first_columns(head) -> None:
    model = model_with_head(head)
    cache = PagedKVCache.allocate(model.config, 4, 16, torch.bfloat16)
    batch = Batch.build([list(range(5, 40, 3)), [7, 9]], [0, 0], [[0], [1]], 16, all_logits=True)
    whole = model(batch, cache)
    assert whole.shape == (14, CONFIG.vocab_size)
    # 100: not a whole tile; the packed heads compute the tile it ends in and keep 100.
    for rows in (16, 100, 512, CONFIG.vocab_size):
        first = model(batch, cache, logit_rows=rows)
        assert first.shape == (14, rows)
        if head == "float":
            scale = whole.abs().max()
            assert (first - whole[:, :rows]).abs().max() <= 1e-2 * scale, rows
        else:
            assert torch.equal(first, whole[:, :rows]), rows


def test_the_config_takes_it_for_a_draft_model() -> None:
    from scheduler.spec.speculation import SpeculativeConfig

    text = '{"model": "draft.gguf", "num_speculative_tokens": 2%s}'
    assert SpeculativeConfig.parse(text % "").draft_vocab_size == 65536
    assert SpeculativeConfig.parse(text % ', "draft_vocab_size": 4096').draft_vocab_size == 4096
    assert SpeculativeConfig.parse(text % "").draft_p_min == 0.5
    assert SpeculativeConfig.parse(text % ', "draft_p_min": 0').draft_p_min == 0.0
    assert SpeculativeConfig.parse(text % ', "draft_p_min": 0.25').draft_p_min == 0.25
