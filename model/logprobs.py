"""Log-probabilities of given tokens under a batch of logits, with the top-N alternatives:
what prompt logprobs (`echo` with `logprobs`) report. Batched tensor code; it never
samples."""

import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [n, V], targets [n] -> (logprob of each target [n], top-N ids and logprobs
    [n, N], or None when num_top is 0)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    if num_top <= 0:
        return chosen, None, None
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_ids, top_values
