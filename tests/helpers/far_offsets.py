"""Tensors whose element offsets pass 2^31 without allocating 2^31 elements' worth of pages."""

import torch

INT32_SPAN = 1 << 31


def far_apart_views(tensors: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one shape and dtype, 3 entries along ``dim``) as views of one
    storage in which entry 2 along ``dim`` lies 2^31 elements past entry 0.

    The ``dim`` stride (2^30) fits in int32, so a kernel that multiplies an int32 index by it
    wraps; the views start 2^31 elements into the storage, so a wrapped offset still lands inside
    it (a wrong row read or written, not a fault). The other dims are packed, and the tensors
    interleave, one packed slice after another. The storage is ~8 GiB of address space of which
    only the written pages are touched (a CPU allocation is lazy).
    """
    shape = tensors[0].shape
    assert shape[dim] == 3 and all(t.shape == shape for t in tensors)
    strides = [0] * len(shape)
    packed = 1
    for d in reversed(range(len(shape))):
        if d != dim:
            strides[d] = packed
            packed *= shape[d]
    strides[dim] = INT32_SPAN // 2
    storage = torch.empty(
        2 * INT32_SPAN + len(tensors) * packed, dtype=tensors[0].dtype, device=tensors[0].device
    )
    views = []
    for i, tensor in enumerate(tensors):
        view = storage.as_strided(shape, strides, INT32_SPAN + i * packed)
        view.copy_(tensor)
        views.append(view)
    return views
