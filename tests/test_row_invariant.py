"""--batch-invariant's float32 products: a row's result is the bits PyTorch's own product
gives it in a batch of many rows, whatever the number of rows it is computed with; the
model's float32 linear layers take that form, tied weights stay tied."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.row_invariant import PROBE_ROWS, RowInvariantLinear, make_rows_invariant


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (96, 7000)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_come_out_as_in_a_large_batch(in_features, out_features, bias) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias)
    linear = RowInvariantLinear.sharing(plain)
    x = torch.randn(2 * PROBE_ROWS, in_features)
    with torch.no_grad():
        want = F.linear(x, plain.weight, plain.bias)  # 64 rows: no padding on either side
        for rows in range(1, 2 * PROBE_ROWS + 1):
            got = linear(x[:rows])
            assert got.shape == (rows, out_features)
            assert torch.equal(got, want[:rows]), rows
        # Leading dimensions are kept: [batch, tokens, features].
        assert torch.equal(linear(x[:6].view(2, 3, -1)), want[:6].view(2, 3, -1))


def test_the_models_float32_linears_become_row_invariant() -> None:
    from model.loader import load_model

    loaded = load_model(batch_invariant=True, progress=False)
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is RowInvariantLinear for m in linears)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    assert model.attention.every_query_alone


def test_quantised_and_bfloat16_layers_are_left_alone() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 4))
    )
    assert make_rows_invariant(model) == 2
    assert [type(m) for m in model.modules()][1:] == [
        RowInvariantLinear,
        nn.Linear,
        nn.Sequential,
        RowInvariantLinear,
    ]
