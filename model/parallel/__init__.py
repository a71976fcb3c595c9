"""Tensor parallelism: every rank holds 1/N of each layer (Megatron-style), and the ranks
meet in two all-reduces per layer plus one gather of the logits, over `torch.distributed`
(gloo on CPU, NCCL on CUDA)."""
