"""From a `SchedulerOutput` to tensors: the flat `Batch` for the forward and the
`SamplingMetadata` for the sampler, plus which logits row belongs to which sequence.

Pure functions of plain values; they never change what they are handed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.network.batch import Batch
from model.sampler import SamplingMetadata
from scheduler.sampling_params import ROW_FIELDS, SamplingParams
from scheduler.step_data import ScheduledRequest


@dataclass
class StepInputs:
    batch: Batch
    # Per scheduled sequence, the logits rows of this step's tokens it owns: all of them
    # when prompt logprobs are owed or guesses are verified, else only the last.
    first_row: list[int]
    num_rows: list[int]

    def last_row(self, index: int) -> int:
        return self.first_row[index] + self.num_rows[index] - 1


def build_step_inputs(
    scheduled: list[ScheduledRequest], block_size: int, null_block: int, device: torch.device
) -> StepInputs:
    every_row = [s.prompt_logprobs_from is not None or bool(s.draft_token_ids) for s in scheduled]
    batch = Batch.build(
        [s.new_token_ids for s in scheduled],
        [s.num_computed_tokens for s in scheduled],
        [s.block_table for s in scheduled],
        block_size,
        device,
        all_logits=every_row if any(every_row) else False,
        null_block=null_block,
    )
    num_rows = [
        len(s.new_token_ids) if every else 1 for s, every in zip(scheduled, every_row, strict=True)
    ]
    first_row, row = [], 0
    for n in num_rows:
        first_row.append(row)
        row += n
    return StepInputs(batch, first_row, num_rows)


def sampling_metadata(
    rows: list[ScheduledRequest],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
    token_bitmasks: list[np.ndarray | None] | None = None,
) -> SamplingMetadata:
    """`rows`: the sequence each sampled row belongs to; `token_bitmasks`: each row's
    grammar mask, None for an unconstrained row."""
    return params_metadata(
        [s.params for s in rows],
        generators,
        vocab_size,
        device,
        suppress_ids=[sorted(s.suppress_token_ids) for s in rows],
        prompt_ids=[s.prompt_ids for s in rows],
        output_ids=[s.output_ids for s in rows],
        token_bitmasks=token_bitmasks,
    )


def params_metadata(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
    *,
    suppress_ids: list[list[int]],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    token_bitmasks: list[np.ndarray | None] | None = None,
) -> SamplingMetadata:
    """Each row's parameters as the sampler takes them: the per-row ones (`ROW_FIELDS`)
    under their own names, the logprobs the most any row asks for."""
    want = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata.build(
        **{name: [getattr(p, name) for p in params] for name in ROW_FIELDS},
        logit_bias=[p.logit_bias for p in params],
        suppress_ids=suppress_ids,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        generators=generators,
        num_logprobs=max(want, default=-1),
        vocab_size=vocab_size,
        device=device,
        token_bitmasks=token_bitmasks,
    )
