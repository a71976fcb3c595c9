"""Grammar bitmasks on logits: structured output's allowed tokens, as llguidance packs them
(bit t % 32 of int32 word t // 32), stacked for the rows that carry one and applied to a
step's logits in one unpack."""

from __future__ import annotations

import numpy as np
import torch


def stack_bitmasks(
    per_row: list[np.ndarray | None], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows that carry a grammar's bitmask, and their masks stacked: (rows [n], bitmask
    [n, words]), or None where no row does."""
    rows = [i for i, mask in enumerate(per_row) if mask is not None]
    if not rows:
        return None
    bitmask = torch.from_numpy(np.stack([per_row[i] for i in rows])).to(device)
    return torch.tensor(rows, dtype=torch.int64, device=device), bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: in each of `rows`, every token whose bit is clear in its bitmask row
    (llguidance's layout: bit t % 32 of int32 word t // 32) becomes -inf. Token ids past
    the bitmask are not allowed either. One unpack for all rows, no loop over them."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))
