"""The network: `Llama` (model/network/llama.py) and its parts (decoder layer, RoPE,
the paged KV cache it reads, the `Batch` it is handed), built empty and filled from a
checkpoint's HF-named tensors."""
