"""The second peer: Hugging Face `transformers` `generate` on the same GGUF and the same
prompts, all of a scenario's prompts in batches of its client count, greedy, every output
`max_tokens` long. Run as its own process so its memory is its own:

    echo '{"prompts": [[1, 2, 3]], "batch": 1, "max_tokens": 8}' | python -m bench.transformers_peer

Prints one JSON line: output tokens, wall seconds and peak RSS. There is no streaming, so
no TTFT or inter-token latency: only throughput compares.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from model.checkpoint.default_model import default_model_path_or_none

    job = json.loads(sys.stdin.read())
    path = Path(job.get("model") or default_model_path_or_none())
    torch.set_num_threads(job.get("threads", 2))
    device = job.get("device", "cpu")
    model = (
        AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, job.get("dtype", "float32"))
        )
        .eval()
        .to(device)
    )
    prompts, batch, max_tokens = job["prompts"], job["batch"], job["max_tokens"]
    output_tokens = 0
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        ids = torch.tensor(
            group, device=device
        )  # every prompt of a scenario has the same length: no padding
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),  # never inferred from pad = eos ids
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
        output_tokens += (out.shape[1] - ids.shape[1]) * len(group)
    wall_s = time.perf_counter() - started
    peak_kib = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    print(
        json.dumps({"output_tokens": output_tokens, "wall_s": wall_s, "peak_rss": peak_kib * 1024})
    )


if __name__ == "__main__":
    main()
