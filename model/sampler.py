"""Sampling: one step's logits [B, V] -> one token id per row, plus raw logprobs; and the
logprob math prompt logprobs share.

Owns the order in which logits are shaped (grammar bitmask, suppression and bias,
repetition penalty, frequency and presence penalties, temperature, top-k, top-p, min-p) and
how randomness is drawn. Per-row parameters are tensors, so a step costs the same few
kernels whatever mix of requests it holds; the only loop over rows is over those with their
own seeded generator. It must never see a request: the engine builds `SamplingMetadata` from
plain lists, and nothing here mutates the caller's logits or reads state beyond what it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from model.token_bitmask import apply_token_bitmask, stack_bitmasks

# A row whose temperature is exactly this is greedy: SamplingParams (scheduler/sampling_params.py)
# maps every temperature too small to divide by to it.
_GREEDY_TEMPERATURE = 0.0
# A C argmax over float rows (model/native/ops.py's NativeArgmax): ids, or None where it
# does not take these logits.
Argmax = Callable[[torch.Tensor], torch.Tensor | None]


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded sequence's draw at one output position: splitmix64 of the
    pair, so every bit of the request's seed and the position reaches the low 32 bits,
    all that PyTorch's CPU generator (mt19937) keeps."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _flat_index(per_row: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """(row, token id) pairs for every id of every row, for one vectorised index_put."""
    rows = [i for i, ids in enumerate(per_row) for _ in ids]
    ids = list(chain.from_iterable(per_row))
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
    )


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0.0: the row is greedy
    top_k: torch.Tensor  # [B] int64; 0 means off
    top_p: torch.Tensor  # [B] float32; 1.0 means off
    min_p: torch.Tensor  # [B] float32; 0.0 means off
    # Each penalty is None when no row uses it, so an unpenalised batch builds no [B, V] table.
    presence_penalty: torch.Tensor | None  # [B] float32; 0.0 means off
    frequency_penalty: torch.Tensor | None  # [B] float32; 0.0 means off
    repetition_penalty: torch.Tensor | None  # [B] float32; 1.0 means off
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences of each id in the output
    seen_mask: torch.Tensor | None  # [B, V] bool: id occurs in prompt or output (repetition)
    logit_bias: tuple[torch.Tensor, ...] | None  # (rows, ids, values), flat over all rows
    suppress: tuple[torch.Tensor, ...] | None  # (rows, ids), flat; these logits become -inf
    # (rows, bitmask [k, W] int32): the constrained rows and the tokens their grammar allows
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None
    generators: list[torch.Generator | None]  # on the logits' device
    num_logprobs: int  # -1: none; 0: the sampled token's; N: also the top N alternatives
    all_greedy: bool
    # Host-side facts, so the hot path never waits on the device to learn what to skip.
    all_random: bool
    seeded_rows: list[int]  # rows that sample (not greedy) with their own generator
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @classmethod
    def build(
        cls,
        *,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        presence_penalty: list[float],
        frequency_penalty: list[float],
        repetition_penalty: list[float],
        logit_bias: list[dict[int, float] | None],
        suppress_ids: list[list[int]],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        num_logprobs: int,
        vocab_size: int,
        device: torch.device | str,
        token_bitmasks: list[np.ndarray | None] | None = None,
    ) -> SamplingMetadata:
        """`token_bitmasks`: per row, its grammar's allowed-token bits, or None when the
        row is unconstrained."""
        num_rows = len(temperature)
        # Parameters on greedy rows change nothing, so only sampling rows switch work on.
        sampling = [i for i, t in enumerate(temperature) if t != _GREEDY_TEMPERATURE]

        def row_tensor(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        use_presence = any(p != 0.0 for p in presence_penalty)
        use_frequency = any(f != 0.0 for f in frequency_penalty)
        use_repetition = any(r != 1.0 for r in repetition_penalty)
        output_counts = seen_mask = None
        if use_presence or use_frequency or use_repetition:
            rows, ids = _flat_index(output_ids, device)
            output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
            ones = torch.ones_like(ids, dtype=torch.float32)
            output_counts.index_put_((rows, ids), ones, accumulate=True)
        if use_repetition:
            seen_mask = output_counts > 0
            seen_mask[_flat_index(prompt_ids, device)] = True

        bias = None
        entries = [(i, t, v) for i, b in enumerate(logit_bias) if b for t, v in b.items()]
        if entries:
            rows_b, ids_b, values_b = zip(*entries, strict=True)
            bias = (
                torch.tensor(rows_b, dtype=torch.int64, device=device),
                torch.tensor(ids_b, dtype=torch.int64, device=device),
                row_tensor(list(values_b)),
            )

        return cls(
            temperature=row_tensor(temperature),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=row_tensor(top_p),
            min_p=row_tensor(min_p),
            presence_penalty=row_tensor(presence_penalty) if use_presence else None,
            frequency_penalty=row_tensor(frequency_penalty) if use_frequency else None,
            repetition_penalty=row_tensor(repetition_penalty) if use_repetition else None,
            output_counts=output_counts,
            seen_mask=seen_mask,
            logit_bias=bias,
            suppress=_flat_index(suppress_ids, device) if any(suppress_ids) else None,
            token_bitmask=stack_bitmasks(token_bitmasks or [], device),
            generators=generators,
            num_logprobs=num_logprobs,
            all_greedy=not sampling,
            all_random=len(sampling) == num_rows,
            seeded_rows=[i for i in sampling if generators[i] is not None],
            use_top_k=any(0 < top_k[i] < vocab_size for i in sampling),
            use_top_p=any(top_p[i] < 1.0 for i in sampling),
            use_min_p=any(min_p[i] > 0.0 for i in sampling),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: raw log-softmax at the sampled token
    top_ids: torch.Tensor | None  # [B, N] int64: top N ids by raw logprob
    top_logprobs: torch.Tensor | None  # [B, N] float32


class Sampler:
    """Stateless: everything a step needs arrives in `SamplingMetadata`. `argmax`: the C
    argmax the kernel plan gives CPU rows (model/plan/kernel_plan.py), None: PyTorch's."""

    def __init__(self, argmax: Argmax | None = None) -> None:
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        processed = self.process_logits(logits, meta)
        if meta.all_greedy:
            token_ids = greedy_ids(processed, self.argmax)
        else:
            token_ids = _sample(processed, meta, self.argmax)
        if meta.num_logprobs < 0:
            return SamplerOutput(token_ids, None, None, None)
        # Logprobs report what the model believes, not what the request's sampling shaped,
        # so they come from the raw logits (as OpenAI and vLLM report them).
        logprobs, top_ids, top_logprobs = token_logprobs(logits, token_ids, meta.num_logprobs)
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Suppression, logit bias and penalties: the logits greedy rows take the argmax of.
        Returns `logits` itself when nothing applies, otherwise a new tensor."""
        if (
            meta.suppress is None
            and meta.token_bitmask is None
            and meta.logit_bias is None
            and meta.repetition_penalty is None
            and meta.frequency_penalty is None
            and meta.presence_penalty is None
        ):
            return logits
        logits = logits.clone()
        if meta.token_bitmask is not None:
            apply_token_bitmask(logits, *meta.token_bitmask)
        if meta.logit_bias is not None:
            rows, ids, values = meta.logit_bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if meta.suppress is not None:
            logits[meta.suppress] = float("-inf")
        if meta.repetition_penalty is not None:
            # HF's rule: dividing a negative logit would raise it, so those are multiplied.
            penalty = meta.repetition_penalty[:, None]
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(meta.seen_mask, penalised, logits)
        if meta.frequency_penalty is not None:
            logits -= meta.frequency_penalty[:, None] * meta.output_counts
        if meta.presence_penalty is not None:
            logits -= meta.presence_penalty[:, None] * (meta.output_counts > 0)
        return logits


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The one logprob rule, for sampled tokens and prompt tokens alike: logits [n, V],
    targets [n] -> (log-softmax at each target [n], top-N ids and logprobs [n, N], or None
    when num_top is 0)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    if num_top <= 0:
        return chosen, None, None
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_ids, top_values


def greedy_ids(logits: torch.Tensor, argmax: Argmax | None = None) -> torch.Tensor:
    """torch.argmax over the vocabulary, in C for CPU rows where the kernel plan gives
    `argmax` (model/native/argmax.c, the same answer), where PyTorch's is a scalar loop of
    0.65 ms per step of 32 decodes."""
    kernel = argmax if logits.device.type == "cpu" else None
    ids = kernel(logits) if kernel is not None else None
    return ids if ids is not None else logits.argmax(dim=-1)


def _sample(
    logits: torch.Tensor, meta: SamplingMetadata, argmax: Argmax | None = None
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and one exponential race per row; greedy rows ride
    along with temperature 1 and are replaced by their argmax at the end."""
    greedy = meta.temperature == _GREEDY_TEMPERATURE
    temperature = torch.where(greedy, 1.0, meta.temperature)
    scaled = logits / temperature[:, None]
    if meta.use_top_k or meta.use_top_p:
        scaled = _top_k_top_p(scaled, meta)
    probs = torch.softmax(scaled, dim=-1)
    if meta.use_min_p:
        floor = meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < floor, 0.0)

    # Exponential race: argmax(p / q) with q ~ Exp(1) picks id i with probability
    # p_i / sum(p), so filtered probs need no renormalising, and every row consumes exactly
    # one [V] draw per step. A seeded row draws from its own generator only, which makes its
    # tokens independent of whatever else shares the batch.
    race = torch.empty_like(probs)
    if len(meta.seeded_rows) < race.shape[0]:
        race.exponential_()
    for row in meta.seeded_rows:
        race[row].exponential_(generator=meta.generators[row])
    # exponential_ may return 0 for a uniform draw at the edge; 0/0 would be NaN, which
    # argmax ranks above everything, so a filtered id could win.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    sampled = probs.div_(race).argmax(dim=-1)
    if meta.all_random:
        return sampled
    return torch.where(greedy, greedy_ids(logits, argmax), sampled)


def _top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Set to -inf what top-k drops, then what top-p drops among top-k's survivors (their
    renormalised probabilities, as HF and vLLM apply them); one descending sort serves both."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if meta.use_top_k:
        rank = torch.arange(vocab_size, device=logits.device)
        k = torch.where(meta.top_k > 0, meta.top_k, vocab_size)
        sorted_logits.masked_fill_(rank >= k[:, None], float("-inf"))
    if meta.use_top_p:
        probs = sorted_logits.softmax(dim=-1)
        # An id stays while the mass ranked above it has not reached top_p: the smallest set
        # that reaches it. Rows at 1.0 are left whole rather than trusting float cumsums
        # near 1, and the top id always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= meta.top_p[:, None]) & (meta.top_p < 1.0)[:, None]
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(-1, order, sorted_logits)
