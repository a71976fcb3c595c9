"""The KV-cache tensors: one K and one V tensor per layer, shaped
[num_blocks + 1, block_size, n_kv_heads, head_dim], allocated once at start-up; an int8
cache's last dimension is head_dim + 2, each slot's values then its scale
(model/network/kv_int8.py). The extra
block, the last, is the null block: it pads block tables and belongs to no request.

Which block belongs to which request is the scheduler's business (its KVCacheManager);
this module only holds memory and never allocates blocks.
"""

import math
import mmap
from dataclasses import dataclass, field

import torch

from model.config import ModelConfig
from model.network.kv_int8 import slot_width


@dataclass
class PagedKVCache:
    k: torch.Tensor  # [n_layers, num_blocks, block_size, n_kv_heads, head_dim]
    v: torch.Tensor
    block_size: int
    # Each layer's (K, V) views, made once: a view costs about a microsecond, twice per
    # layer per step.
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Indexed one by one, not unbind's views: those may not be written in place.
        self.layers = [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "PagedKVCache":
        """num_blocks: the blocks requests can hold (ids 0..num_blocks - 1); dtype
        torch.int8: the int8 layout."""
        width = slot_width(config.head_dim) if dtype == torch.int8 else config.head_dim
        shape = (config.n_layers, num_blocks + 1, block_size, config.n_kv_heads, width)
        return cls(
            k=_zeros(shape, dtype, torch.device(device)),
            v=_zeros(shape, dtype, torch.device(device)),
            block_size=block_size,
        )

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1]) - 1

    @property
    def quantized(self) -> bool:
        return self.k.dtype == torch.int8

    @property
    def null_block(self) -> int:
        return self.num_blocks

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[index]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros (unwritten slots must hold finite values: attention multiplies masked ones by
    0, and 0 * NaN is NaN). On the CPU they are an anonymous mapping, the kernel's zero
    pages: a page becomes resident only when a block on it is written, so a generous KV
    budget costs memory only as far as it is used. Not numpy's zeros: numpy asks for huge
    pages on large arrays, and the first step's one block per layer then made 2 MB per
    layer resident, 116 MB for the default model."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(num_bytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps `buffer` alive as long as the tensor.
    return torch.frombuffer(buffer, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)
