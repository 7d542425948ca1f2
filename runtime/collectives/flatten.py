"""One flat buffer from many tensors, and back: the flattening every caller of a collective that
averages a list of tensors needs (one collective per dtype however many tensors there are).

`dtype_groups` groups a list's indices by dtype, `flatten` copies tensors of one dtype into one
new contiguous 1-D buffer, in list order, and `unflatten` cuts such a buffer back into views
shaped like the tensors it was made from. Pure tensor code: no transport, no trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from paramsync.runtime.errors import CollectiveError

if TYPE_CHECKING:
    import torch

__all__ = ["dtype_groups", "flatten", "unflatten"]


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` grouped by dtype: each group in list order, the groups in the
    order of their dtype's first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    return list(groups.values())


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous 1-D tensor holding ``tensors`` (all of one dtype) one after another, in
    list order; detached from autograd. ``dtype``: the empty buffer's dtype when ``tensors`` is
    empty (default float32). Tensors of different dtypes are a `CollectiveError` naming both."""
    import torch

    if not tensors:
        return torch.zeros(0, dtype=dtype if dtype is not None else torch.float32)
    first = tensors[0].dtype
    for index, tensor in enumerate(tensors):
        if tensor.dtype != first:
            raise CollectiveError(
                f"flatten needs tensors of one dtype: tensor 0 is {first}, tensor {index} is "
                f"{tensor.dtype} (group them with dtype_groups)"
            )
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``like``, in order (the inverse of `flatten`). A
    buffer whose size is not theirs together is a `CollectiveError` naming both sizes."""
    total = sum(tensor.numel() for tensor in like)
    if flat.dim() != 1 or flat.numel() != total:
        raise CollectiveError(
            f"unflatten: a flat buffer of shape {list(flat.shape)} does not hold the "
            f"{len(like)} tensors' {total} elements"
        )
    views = []
    offset = 0
    for tensor in like:
        views.append(flat[offset : offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    return views
