"""Plain-PyTorch paged attention: the CPU path and the reference every kernel is
tested against.

Sequences are split into two groups, each handled by one batched call with no Python
loop per sequence: rows with a single new token (decodes: the attention formula written
out as two matrix products) and rows with several (prefill chunks, with or without a
cached prefix: SDPA). Each group gathers its K/V through
the block tables into a padded [B, max_context, n_kv_heads, head_dim] tensor and masks
what lies past a sequence's length or after a query's own position.

Like every backend it never allocates blocks or sees a request; it must stay the
plainest correct code, because every faster kernel is judged against it.
"""

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from model.attention.base import AttentionBackend, write_kv
from model.network.batch import Batch
from model.network.kv_int8 import dequantize, is_int8


@dataclass
class _Group:
    token_index: torch.Tensor  # [B, max_q] flat token index of each (row, query) slot
    block_tables: torch.Tensor  # [B, blocks needed by the longest row]
    mask: torch.Tensor  # [B, 1, max_q, max_context] bool, True = may attend
    # Each slot's position ([B, 1, max_q, 1]) and the key positions ([max_context]), from
    # which a sliding window's mask is made once per step and window size.
    q_pos: torch.Tensor
    key_pos: torch.Tensor
    # Where the valid slots' outputs go among the batch's tokens, and where they are among
    # the group's B * max_q slots: found once per step, not once per layer.
    dest: torch.Tensor
    src: torch.Tensor
    # The group is the whole batch, every row the same length and in order (all decodes,
    # or one prefill chunk): its slots are the tokens themselves, nothing to gather.
    whole: bool
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            self.windowed[window] = self.mask & (self.key_pos > self.q_pos - window)
        return self.windowed[window]


@dataclass
class TorchRefPlan:
    """A step's groups, planned when first read: a step whose layers all run whole in C
    (model/native/layer.py) never reads them, and planning them cost a one-stream decode
    step about 60 microseconds of small tensor ops."""

    batch: Batch

    @cached_property
    def groups(self) -> list[_Group]:
        decodes = [i for i, q in enumerate(self.batch.query_lens) if q == 1]
        prefills = [i for i, q in enumerate(self.batch.query_lens) if q > 1]
        return [_plan_group(self.batch, rows) for rows in (decodes, prefills) if rows]


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def plan(self, batch: Batch) -> TorchRefPlan:
        return TorchRefPlan(batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: Batch,
        plan: TorchRefPlan,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = None if plan.groups[0].whole else q.new_empty(q.shape)
        for g in plan.groups:  # at most two: decodes, prefills
            rows, max_q = g.token_index.shape
            if g.whole:
                queries = q.reshape(rows, max_q, *q.shape[1:])
            else:
                queries = q[g.token_index]  # [B, max_q, n_heads, head_dim]
            attn = self.attend(queries, k_cache, v_cache, g, plan, scale, window, sinks)
            if g.whole:
                return attn.reshape(q.shape)
            out[g.dest] = attn.flatten(0, 1)[g.src]
        return out

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        queries: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _Group,
        plan: TorchRefPlan,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One group's attention: queries [B, max_q, n_heads, head_dim], the same out."""
        rows = queries.shape[0]
        n_kv, width = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache[group.block_tables].view(rows, -1, n_kv, width)
        values = v_cache[group.block_tables].view(rows, -1, n_kv, width)
        if is_int8(k_cache):  # the gathered slots, dequantised to fp32
            keys, values = dequantize(keys), dequantize(values)
        mask = group.mask_for(window)
        if sinks is not None:
            return _sink_attention(queries, keys, values, mask, scale, sinks)
        if queries.shape[1] == 1:
            return _decode_attention(queries, keys, values, mask, scale)
        return F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2).to(queries.dtype),
            values.transpose(1, 2).to(queries.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)


def _decode_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """softmax(q K^T) V for one query per row, written out in fp32 whatever the cache
    holds: for each KV head, its group of query heads against that head's keys is one
    batched matrix product, reading the gathered keys through strides. Permuting the
    gathered keys to [B, kv, d, T] instead made a strided copy of all of them, half of a
    32-sequence decode step's attention time on a CPU; SDPA's flash kernel is slower still
    at one query (its set-up dominates). queries [B, 1, n_heads, d]; keys, values
    [B, T, n_kv, d]."""
    rows, _, n_heads, head_dim = queries.shape
    n_kv = keys.shape[2]
    grouped = queries.view(rows, n_kv, n_heads // n_kv, head_dim).float()
    keys, values = keys.float(), values.float()
    hidden = ~mask.view(rows, 1, -1)
    heads = []
    for head in range(n_kv):
        scores = torch.bmm(grouped[:, head], keys[:, :, head].transpose(1, 2)) * scale
        scores.masked_fill_(hidden, float("-inf"))
        heads.append(torch.bmm(torch.softmax(scores, dim=-1), values[:, :, head]))
    return torch.stack(heads, dim=1).view(rows, 1, n_heads, head_dim).to(queries.dtype)


def _sink_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """gpt-oss's attention written out in fp32, as transformers' eager one: each head's
    sink logit is one more column of its scores, softmaxed with them and then dropped.
    queries [B, Q, n_heads, d]; keys, values [B, T, n_kv, d]; mask [B, 1, Q, T]."""
    rows, max_q, n_heads, head_dim = queries.shape
    n_kv = keys.shape[2]
    grouped = queries.float().view(rows, max_q, n_kv, n_heads // n_kv, head_dim)
    scores = torch.einsum("bqkgd,btkd->bkgqt", grouped, keys.float()) * scale
    scores = scores.masked_fill(~mask.view(rows, 1, 1, max_q, -1), float("-inf"))
    sink = sinks.float().view(1, n_kv, n_heads // n_kv, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bkgqt,btkd->bqkgd", probs, values.float())
    return out.reshape(rows, max_q, n_heads, head_dim).to(queries.dtype)


def _plan_group(batch: Batch, rows: list[int]) -> _Group:
    device = batch.input_ids.device
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    q_lens = torch.tensor([batch.query_lens[r] for r in rows], device=device)
    ctx_lens = torch.tensor([batch.seq_lens[r] for r in rows], device=device)
    max_q = max(batch.query_lens[r] for r in rows)
    max_ctx = max(batch.seq_lens[r] for r in rows)
    n_blocks = -(-max_ctx // batch.block_size)

    cols = torch.arange(max_q, device=device)
    valid = cols[None, :] < q_lens[:, None]
    starts = batch.query_start_loc[rows_t]
    token_index = torch.where(valid, starts[:, None] + cols[None, :], starts[:, None])

    # A query at position p sees keys 0..p; padding queries take the last position's keys
    # so that no softmax row is empty (their outputs are discarded).
    q_pos = torch.minimum((ctx_lens - q_lens)[:, None] + cols[None, :], ctx_lens[:, None] - 1)
    keys = torch.arange(n_blocks * batch.block_size, device=device)
    mask = keys[None, None, :] <= q_pos[:, :, None]
    num_tokens = batch.input_ids.shape[0]
    whole = len(rows) * max_q == num_tokens and all(
        batch.query_lens[r] == max_q for r in rows
    )  # equal lengths summing to the batch: every token, each row's run in order
    return _Group(
        token_index=token_index,
        block_tables=batch.block_tables[rows_t, :n_blocks],
        mask=mask.unsqueeze(1),
        q_pos=q_pos[:, None, :, None],
        key_pos=keys,
        dest=token_index[valid],
        src=valid.flatten().nonzero().squeeze(1),
        whole=whole,
    )
