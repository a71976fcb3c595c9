"""Which decoder linear layers run in another format than the model's: a GGUF file that
mixes block types (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0) runs each layer in the narrowest format
that holds its own type. The model's format (model/plan/weight_format.py) covers the 4-bit
layers; `wide` ones take its `wide` format; those whose every matrix is Q5_0 take int5,
its own format in 5.5 bits a weight where grouped int8 takes 8.5, and those all Q6_K take
int6 (6.625 bits), each where it times no slower beyond `NEAR_TIE` (fewer bytes are
certain, a small timing lead is not)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

import torch

from model.config import ModelConfig
from model.plan import weight_format
from model.plan.int6_activations import remembered_shape_ms
from model.plan.mode import allows_native
from model.plan.timing import one_thread_geometric_ms
from model.plan.tuning import config_key, remembered
from model.plan.weight_format import MEASURED_BATCH_SIZES, NEAR_TIE, WeightFormat, int4_fits
from model.quant.int6 import SUPER_BLOCK as INT6_SUPER_BLOCK
from model.quant.int6 import Int6Linear, on_grid
from model.quant.int8_group import Int8GroupLinear
from model.quant.split import split_name

logger = logging.getLogger(__name__)

LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Q/K/V and gate/up fused
LINEARS_PER_LAYER = len(LINEAR_NAMES)
INT8G, INT5 = WeightFormat(torch.bfloat16, "int8g"), WeightFormat(torch.bfloat16, "int5")
INT6 = WeightFormat(torch.bfloat16, "int6")


def layer_quantizations(
    fmt: WeightFormat,
    config: ModelConfig,
    device: torch.device,
    wide: frozenset[str],
    q5_0: frozenset[str],
    chosen: bool = True,
    q6_k: frozenset[str] = frozenset(),
    mode: str = "auto",
    mxfp4: frozenset[str] = frozenset(),
    split_qkv: Mapping[str, tuple[str, str]] = MappingProxyType({}),
) -> dict[str, str]:
    """The layers ('layers.3.down_proj') whose quantization is not `fmt.quantization`,
    with their own; `wide`: those stored in more than 4 bits, `q5_0` and `q6_k`: those all
    Q5_0 or all Q6_K; `chosen`: the format was `auto`'s choice (a quantization asked for by
    name is kept, but for w4a8's wider layers). In w4a8 Q5_0 layers take w5a8: their own
    format, with the model's int8 activations; so do Q6_K ones (w6a8) where the CPU has no
    bf16 products (`q6_k_in_w6a8`), and there the layers left in grouped int8 (w8a8).
    `mxfp4`: those all MXFP4, held as they are in any format, on any device. `split_qkv`: the
    fused Q/K/V layers whose V alone is wider, with (Q and K's block type, V's): they hold Q
    and K in their own format (the model's int4, or int5's for Q5_0) and V in its own
    (model/quant/split.py), where no tensor parallelism slices them (pass none)."""
    own = dict.fromkeys(wide, fmt.wide) if fmt.wide else {}
    own.update(dict.fromkeys(mxfp4, "mxfp4"))
    native = device.type == "cpu" and allows_native(mode)
    int8_activations = fmt.quantization == "w4a8" and fmt.wide is not None
    if not ((chosen or int8_activations) and native and int4_fits(config)):
        return own

    def in_int8g(keys: frozenset[str]) -> list[str]:
        return [key for key in keys if own.get(key, fmt.quantization) == INT8G.quantization]

    q5 = in_int8g(q5_0)
    # Q/K/V layers whose V alone is wider: Q and K in their own format, V in its own.
    split = in_int8g(frozenset(split_qkv)) if qkv_splits(config) else []
    q5_split = [key for key in split if split_qkv[key][0] == "Q5_0"]
    q5_format = None
    if int8_activations:
        q5_format = "w5a8"
    elif (q5 or q5_split) and int5_pays(config, device):
        q5_format = INT5.quantization
    if q5_format is not None:
        own.update(dict.fromkeys(q5, q5_format))
    first = {key: q5_format if key in q5_split else fmt.quantization for key in split}
    split = [key for key in split if first[key] is not None]
    q6 = [key for key in in_int8g(q6_k) if int6_holds(*key_shape(config, key))]
    v_int6 = int6_holds(config.dim, config.kv_size)
    if int8_activations and q6_k_in_w6a8(mode):
        own.update(dict.fromkeys(q6, "w6a8"))
        # What is left in grouped int8 (Q8_0 layers, fused layers mixing types that cannot
        # be split) takes the same int8 activations (w8a8).
        own.update(dict.fromkeys(in_int8g(frozenset(own)), "w8a8"))
        for key in split:
            v = "w6a8" if v_int6 and split_qkv[key][1] == "Q6_K" else "w8a8"
            own[key] = split_name(first[key], v)
        return own
    for in_features, out_features in sorted({key_shape(config, key) for key in q6}):
        if int6_pays(in_features, out_features):
            same = [key for key in q6 if key_shape(config, key) == (in_features, out_features)]
            own.update(dict.fromkeys(same, INT6.quantization))
    v_q6_k = [key for key in split if split_qkv[key][1] == "Q6_K"]
    v_int6 = v_int6 and bool(v_q6_k) and int6_pays(config.dim, config.kv_size)
    for key in split:
        v = INT6 if v_int6 and key in v_q6_k else INT8G
        if v.quantization != first[key]:  # a model all in grouped int8 keeps the layer whole
            own[key] = split_name(first[key], v.quantization)
    return own


def qkv_splits(config: ModelConfig) -> bool:
    """Whether a fused Q/K/V layer can be held as Q and K in one format and V in another:
    both parts whole tiles of 16 rows."""
    return all(rows % 16 == 0 for rows in split_rows(config))


def int6_holds(in_features: int, out_features: int) -> bool:
    """Whether int6 (Q6_K's super-blocks of 256 inputs, tiles of 16 outputs) takes the shape."""
    return in_features % INT6_SUPER_BLOCK == 0 and out_features % 16 == 0


def split_rows(config: ModelConfig) -> tuple[int, int]:
    """A split Q/K/V layer's rows in each part: Q and K, then V."""
    return config.q_size + config.kv_size, config.kv_size


def q6_k_in_w6a8(mode: str) -> bool:
    """Whether a w4a8 model's Q6_K layers (and output projection) take int8 activations
    too: where the int4 kernel has no bf16 products (an AVX2-only CPU), the int6 kernel
    widens every weight to fp32 and grouped int8 reads 9 bits a weight, while vpmaddubsw
    on the 6.625 stored bits streams at memory speed (docs/cpu-performance.md); with
    AVX-512 BF16 int6 and grouped int8 are timed as before."""
    return weight_format.int8_activations_in_auto(mode)


def int5_pays(config: ModelConfig, device: torch.device) -> bool:
    """Whether Q5_0 layers run in int5 rather than grouped int8: timed once per model
    shape and machine on the layer shapes, as the model's format is."""

    def timed(fmt: WeightFormat) -> float:
        key = {"config": config_key(config), "format": fmt.describe(), "device": str(device)}
        with torch.inference_mode():
            return remembered(
                "linear_layers_ms", key, lambda: weight_format.layer_step_ms(config, fmt, device)
            )

    int5_ms, int8g_ms = timed(INT5), timed(INT8G)
    pays = int5_ms <= int8g_ms * (1 + NEAR_TIE)
    logger.info(
        "Q5_0 layers: %s (linear layers per step: int5 %.1f ms, grouped int8 %.1f ms)",
        "int5" if pays else "grouped int8",
        int5_ms,
        int8g_ms,
    )
    return pays


def int6_pays(in_features: int, out_features: int, logits: bool = False) -> bool:
    """Whether Q6_K layers of this shape (or the output projection, `logits`) run in int6
    rather than grouped int8: fewer bytes, but more work to unpack them, so timed once
    per shape and machine (`int6_and_int8g_ms`)."""
    int6_ms, int8g_ms = remembered_shape_ms(
        "int6_against_int8g_thread_ms", int6_and_int8g_ms, in_features, out_features, logits
    )
    pays = int6_ms <= int8g_ms * (1 + NEAR_TIE)
    logger.info(
        "Q6_K %s [%d, %d]: %s (int6 %.2f ms, grouped int8 %.2f ms)",
        "output projection" if logits else "layers",
        out_features,
        in_features,
        "int6" if pays else "grouped int8",
        int6_ms,
        int8g_ms,
    )
    return pays


def quantized_head_format(
    config: ModelConfig, block_type: str | None, fmt: WeightFormat, mode: str
) -> str:
    """The format of an output projection that runs quantised: grouped int8, or for one
    stored in Q6_K (or tied to an embedding that is) int6 where it times no slower; each on
    int8 activations (w8a8, w6a8) where the model's Q6_K layers take them (`q6_k_in_w6a8`)."""
    int8_activations = fmt.quantization == "w4a8" and fmt.wide is not None and q6_k_in_w6a8(mode)
    if block_type != "Q6_K" or not int6_holds(config.dim, config.vocab_size):
        return "w8a8" if int8_activations else "int8"
    if int8_activations:
        return "w6a8"
    return "int6" if int6_pays(config.dim, config.vocab_size, logits=True) else "int8"


def linear_keys(config: ModelConfig) -> list[str]:
    """Every decoder linear layer's name ('layers.3.down_proj'; a mixture of experts'
    'layers.3.moe.experts.5.down_proj')."""
    keys = []
    for index in range(config.n_layers):
        if config.is_sparse(index):
            keys += [f"layers.{index}.{name}" for name in LINEAR_NAMES[:2]]
            keys += [
                f"layers.{index}.moe.experts.{e}.{name}"
                for e in range(config.n_experts)
                for name in LINEAR_NAMES[2:]
            ]
        else:
            keys += [f"layers.{index}.{name}" for name in LINEAR_NAMES]
    return keys


def describe(fmt: WeightFormat, layer_quantizations: dict[str, str], n_linears: int) -> str:
    """The format with its layers' mix, for the start-up log: 'bfloat16 + int4 (12),
    int5 (60), int8g (24) linear layers'."""
    if not layer_quantizations:
        return fmt.describe()
    counts = Counter(layer_quantizations.values())
    counts[fmt.quantization or str(fmt.dtype).removeprefix("torch.")] += n_linears - len(
        layer_quantizations
    )
    parts = [f"{name} ({n})" for name, n in sorted(counts.items()) if n]
    dtype = str(fmt.dtype).removeprefix("torch.")
    return f"{dtype} + {', '.join(parts)} linear layers"


def key_shape(config: ModelConfig, key: str) -> tuple[int, int]:
    """(in, out) of a layer named 'layers.3.down_proj' (or 'layers.3.moe.experts.5.down_proj')."""
    name = key.rsplit(".", 1)[1]
    if ".experts." in key:
        ffn = config.expert_ffn_dim
        return (config.dim, 2 * ffn) if name == "gate_up_proj" else (ffn, config.dim)
    return layer_shape(config, name)


def layer_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    """(in, out) of a decoder layer's linear layer `name` ('down_proj')."""
    return {
        "qkv_proj": (config.dim, config.q_size + 2 * config.kv_size),
        "o_proj": (config.q_size, config.dim),
        "gate_up_proj": (config.dim, 2 * config.ffn_dim),
        "down_proj": (config.ffn_dim, config.dim),
    }[name]


def int6_and_int8g_ms(in_features: int, out_features: int, logits: bool) -> tuple[float, float]:
    """Milliseconds of one product in int6 and in grouped int8 (geometric mean over the
    batch sizes the weight format is chosen on), on at most 8192 of the output columns:
    the output projection's cost is linear in them; on one thread (`on_one_thread`), in
    its CPU time. On a busy machine the two formats' ratio at a batch size ranged 0.3-2.6
    between two-thread runs in wall time, and Qwen2.5-Coder-1.5B's head went to grouped
    int8 (248 MB a step) where int6 reads 193; one-thread wall times still sent its Q6_K
    down projections to grouped int8 once."""
    rows = min(out_features, 8192)
    weight = on_grid(rows, in_features, torch.Generator().manual_seed(0))
    int6 = Int6Linear(in_features, rows, "cpu", logits=logits)
    int8g = Int8GroupLinear(in_features, rows, "cpu", fp32_output=logits)
    for module in (int6, int8g):
        module.load_rows(0, weight)
    int6_ms, int8g_ms = one_thread_geometric_ms((int6, int8g), in_features, MEASURED_BATCH_SIZES)
    return int6_ms, int8g_ms
