"""What one engine step reports for metrics: gauges read at the end of the step, and the
latencies and token counts it produced. Collected where the events happen, so that an
exporter never has to scan requests. A report with no step (the engine going idle, say
after an abort) carries only the gauges and what finished since the last report."""

from dataclasses import dataclass, field

from scheduler.spec.speculation import SpecCounts


@dataclass
class FinishedStats:
    finish_reason: str
    e2e_s: float
    queue_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    lora_name: str | None = None  # the LoRA adapter it ran with


@dataclass
class StepStats:
    num_tokens: int = 0  # tokens fed to the model this step
    num_prompt_tokens: int = 0  # prompts of requests that got their first token this step
    num_generated: int = 0
    num_preemptions: int = 0
    step_time_s: float = 0.0
    forward_s: float = 0.0  # of step_time_s, the model forward alone
    ttft_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    finished: list[FinishedStats] = field(default_factory=list)
    # gauges and cumulative counters, as of the end of the step
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_loras_resident: int = 0  # LoRA adapters in memory
    spec: SpecCounts | None = None  # what verifying speculated tokens accepted this step
