"""A projection as the C kernels read it (layer_weight.h): its weight bytes, scales and
kind, for the C decoder layer (model/native/layer.py) and the mixture-of-experts FFN
(model/native/moe.py)."""

from __future__ import annotations

import ctypes

import torch

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p

# decoder_layer.c's weight kinds (layer_weight.h): int4 with bf16 or int8 activations,
# grouped int8, int5, int6, MXFP4 with bf16 or int8 activations, int6 and grouped int8 with
# int8 activations, int4 in superblocks with bf16 or int8 activations, one projection in
# two of those (its first rows in one, the rest in the other)
(
    INT4,
    INT4_A8,
    INT8_GROUPS,
    INT5,
    INT6,
    INT5_A8,
    MXFP4,
    MXFP4_A8,
    INT6_A8,
    INT8_GROUPS_A8,
    INT4K,
    INT4K_A8,
    SPLIT,
) = range(13)
# A projection as the C layer reads it: weight bytes, scales, kind.
NativeWeight = tuple[torch.Tensor, torch.Tensor, int]


class WeightStruct(ctypes.Structure):
    """decoder_layer.c's `layer_weight` (layer_weight.h): same fields, same order."""

    _fields_ = [("weight", _PTR), ("scales", _PTR), ("kind", _I64)]


class SplitWeightStruct(ctypes.Structure):
    """layer_weight.h's `split_weight`: same fields, same order."""

    _fields_ = [("first", WeightStruct), ("second", WeightStruct), ("first_rows", _I64)]


def split_weight(first: NativeWeight, second: NativeWeight, first_rows: int) -> NativeWeight:
    """One projection held as two (model/quant/split.py): the `SPLIT` kind, whose weight is
    the struct of both parts' pointers, in a byte tensor kept with them. The parts' tensors
    must outlive it: their module holds them."""
    struct = SplitWeightStruct(
        WeightStruct(first[0].data_ptr(), first[1].data_ptr(), first[2]),
        WeightStruct(second[0].data_ptr(), second[1].data_ptr(), second[2]),
        first_rows,
    )
    data = torch.frombuffer(bytearray(bytes(struct)), dtype=torch.uint8)
    return data, data, SPLIT
