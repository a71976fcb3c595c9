"""The KV-cache tensors: one K and one V tensor per layer, shaped
[num_blocks + 1, block_size, n_kv_heads, head_dim], allocated once at start-up. The extra
block, the last, is the null block: it pads block tables and belongs to no request.

Which block belongs to which request is the scheduler's business (its KVCacheManager);
this module only holds memory and never allocates blocks.
"""

from dataclasses import dataclass

import torch

from model.config import ModelConfig


@dataclass
class PagedKVCache:
    k: torch.Tensor  # [n_layers, num_blocks, block_size, n_kv_heads, head_dim]
    v: torch.Tensor
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "PagedKVCache":
        """num_blocks: the blocks requests can hold (ids 0..num_blocks - 1)."""
        shape = (config.n_layers, num_blocks + 1, block_size, config.n_kv_heads, config.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            block_size=block_size,
        )

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1]) - 1

    @property
    def null_block(self) -> int:
        return self.num_blocks

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]
