"""ZeRO stage 1 on paramsync's collectives: the optimizer state partitioned over a dp group.

`ZeroRedundancyOptimizer` wraps an optimizer the way torch's ``ZeroRedundancyOptimizer`` does,
but partitions elementwise (as DeepSpeed and Megatron's distributed optimizer do) and runs on
`paramsync.runtime.collectives.ring`:

1. the parameters' gradients are copied into one flat buffer (parameters in order, padded with
   zeros to a multiple of the dp size, so it cuts into ``dp`` equal segments);
2. a reduce-scatter averages it, leaving each rank the averaged gradient of its own segment;
3. an inner optimizer, built by ``optimizer_factory([shard])`` over a flat tensor holding only
   this rank's segment of the parameters, steps: its state (momentum, Adam's moments) exists
   for that segment alone, so each rank holds about 1/dp of the optimizer state;
4. an all-gather puts every rank's updated segment back into every rank's parameters.

**Bitwise equal to plain data parallelism.** For an elementwise optimizer (SGD with momentum,
Adam, AdamW: each element's update depends on that element alone) the parameters and the
optimizer state after every step are bitwise those of plain data parallelism that averages the
same flat gradient buffer with ``all_reduce(flat, "avg")`` and steps the same optimizer on the
whole model. Two things make that exact:

- *the same sums.* The ring's all-reduce sums segment s starting at rank s
  (``x_s + x_{s+1} + ... + x_{s-1}``, then divides by dp once, as the reduce-scatter does), while
  `reduce_scatter` sums segment s starting at rank s+1 (so that rank s ends owning it). Float
  addition is not associative, so for dp >= 3 the two disagree in the last bits. Rather than
  change the collective, this wrapper rotates the buffer by one segment before the
  reduce-scatter: rank r then receives segment r+1 of the original layout, summed in exactly
  the all-reduce's order, and that segment is the one rank r owns (its "shard"). Buffers of at
  most ``small_bytes`` take all-reduce's one-round path (every rank sums all ranks in rank
  order); there this wrapper calls `all_reduce` itself and keeps its shard, since both the
  order and the cost are then the all-reduce's.
- *the same update.* An elementwise optimizer computes each element alike whether it sits in
  a per-parameter tensor or in a flat shard (checked by the tests for SGD, Adam and AdamW).

The claim is exact for one flat buffer of this layout (the reference in ``tests/test_zero.py``);
a data-parallel run that all-reduces other buckets sums some elements in another order, and for
dp = 2 (where ``a + b == b + a``) any layout gives the same bits. A parameter without a
gradient contributes zeros and is stepped (as DDP does with unused parameters).

Everything collective is async (``await zero.step()``, ``await zero.state_dict()``), since the
collectives are: every rank of the dp group must call them in the same order.
`ZeroRedundancyOptimizer.state_dict` gathers the full optimizer state in the form of the plain
optimizer's ``state_dict()`` over the model's parameters (so a checkpoint loads into either);
`load_state_dict` keeps this rank's slice of such a state and needs no communication.
`consolidated_digest` is the C-DDP-001 digest of the model with that gathered state, equal to the
digest a plain data-parallel replica computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from paramsync.actors.state.digest import StateDigest, state_digest
from paramsync.runtime.collectives.ring import (
    DEFAULT_CHUNK_BYTES,
    SMALL_ALLREDUCE_BYTES,
    all_gather,
    all_reduce,
    reduce_scatter,
)
from paramsync.runtime.transport.base import Transport

__all__ = ["OptimizerFactory", "ZeroRedundancyOptimizer", "padded_length"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the inner optimizer over a list of tensors (one flat shard here, the model's
parameters for a plain or consolidated optimizer): ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``."""


def padded_length(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (at least ``world_size``)."""
    return max(1, -(-numel // world_size)) * world_size


class ZeroRedundancyOptimizer:
    """ZeRO-1 over the dp group ``group`` (any `Transport`: a `ProcessGroup` or a world).

    ``params`` are the model's parameters (the same ones, in the same order, on every rank; one
    floating dtype, on the CPU as the collectives need). ``optimizer_factory`` builds the inner
    optimizer; it must take one param group. ``chunk_bytes`` and ``small_bytes`` are the
    collectives' (`paramsync.runtime.collectives.ring.all_reduce`); a plain data-parallel run
    compared bitwise with this one must use the same ``small_bytes``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        group: Transport,
        optimizer_factory: OptimizerFactory,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        small_bytes: int = SMALL_ALLREDUCE_BYTES,
    ) -> None:
        self.params: list[torch.Tensor] = list(params)
        if not self.params:
            raise ValueError("ZeroRedundancyOptimizer needs at least one parameter")
        dtype = self.params[0].dtype
        for index, param in enumerate(self.params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"parameter {index} is a {type(param).__name__}, not a tensor")
            if param.dtype != dtype or not param.is_floating_point():
                raise ValueError(
                    f"parameter {index} is {param.dtype}: ZeRO-1 needs one floating dtype for "
                    f"every parameter (parameter 0 is {dtype})"
                )
            if param.device.type != "cpu":
                raise ValueError(
                    f"parameter {index} is on {param.device}: the collectives run on CPU tensors"
                )
        self.group = group
        self.optimizer_factory = optimizer_factory
        self.chunk_bytes = chunk_bytes
        self.small_bytes = small_bytes
        self.dtype = dtype
        self.numel = sum(param.numel() for param in self.params)
        size = group.world_size
        self.padded_numel = padded_length(self.numel, size)
        self.segment = self.padded_numel // size
        self.offsets: list[int] = []
        offset = 0
        for param in self.params:
            self.offsets.append(offset)
            offset += param.numel()
        owned = (group.rank + 1) % size  # see the module docstring: the all-reduce's order
        self.shard_bounds: tuple[int, int] = (owned * self.segment, (owned + 1) * self.segment)
        """This rank's segment of the flat layout (parameters in order, then padding)."""
        self.shard = torch.zeros(self.segment, dtype=dtype)
        """This rank's segment of the parameters: the one tensor the inner optimizer steps."""
        self.read_shard()
        self.optimizer = optimizer_factory([self.shard])
        if len(self.optimizer.param_groups) != 1:
            raise ValueError(
                f"optimizer_factory built {len(self.optimizer.param_groups)} param groups; "
                "ZeRO-1 steps one flat shard, so it takes exactly one"
            )

    # ------------------------------------------------------------------ layout

    def _pieces(self, lo: int, hi: int) -> Iterable[tuple[int, int, int, int]]:
        """(parameter index, start and stop within it, position in [lo, hi)) of every
        parameter overlapping the flat range [lo, hi)."""
        for index, (param, offset) in enumerate(zip(self.params, self.offsets, strict=True)):
            start, stop = max(lo, offset), min(hi, offset + param.numel())
            if start < stop:
                yield index, start - offset, stop - offset, start - lo

    def read_shard(self) -> None:
        """Copy this rank's segment of the parameters into the shard (padding stays zero)."""
        lo, hi = self.shard_bounds
        with torch.no_grad():
            for index, start, stop, at in self._pieces(lo, hi):
                param = self.params[index].detach().reshape(-1)
                self.shard[at : at + stop - start].copy_(param[start:stop])

    def _flat_gradients(self) -> torch.Tensor:
        flat = torch.zeros(self.padded_numel, dtype=self.dtype)
        for index, (param, offset) in enumerate(zip(self.params, self.offsets, strict=True)):
            grad = param.grad
            if grad is None:
                continue
            if grad.shape != param.shape or grad.dtype != self.dtype or grad.is_sparse:
                raise ValueError(
                    f"parameter {index}'s gradient is {grad.dtype} {tuple(grad.shape)}"
                    f"{' sparse' if grad.is_sparse else ''}: ZeRO-1 needs a dense "
                    f"{self.dtype} gradient of shape {tuple(param.shape)}"
                )
            flat[offset : offset + param.numel()].copy_(grad.detach().reshape(-1))
        return flat

    # ------------------------------------------------------------------ the step

    async def reduce_gradients(self) -> torch.Tensor:
        """Average the gradients over the group; return this rank's segment of the average
        (bitwise that segment of ``all_reduce(flat, "avg")``, see the module docstring)."""
        flat = self._flat_gradients()
        lo, hi = self.shard_bounds
        if flat.numel() * flat.element_size() <= self.small_bytes:
            await all_reduce(
                self.group, flat, "avg", chunk_bytes=self.chunk_bytes, small_bytes=self.small_bytes
            )
            return flat[lo:hi].clone()
        # Rotate one segment left: position r of the reduce-scatter is segment r+1 here.
        rotated = torch.roll(flat, -self.segment)
        return await reduce_scatter(self.group, rotated, "avg", chunk_bytes=self.chunk_bytes)

    async def step(self) -> None:
        """One ZeRO-1 step: reduce-scatter the gradients, step this rank's shard, all-gather
        the parameters. Collective: every rank of the group calls it."""
        shard_grad = await self.reduce_gradients()
        self.read_shard()  # the parameters may have been changed since the last step
        self.shard.grad = shard_grad
        self.optimizer.step()
        self.shard.grad = None
        await self.gather_parameters()

    async def gather_parameters(self) -> None:
        """Write every rank's shard into every rank's parameters (an all-gather)."""
        flat = await self._gather_flat(self.shard)
        with torch.no_grad():
            for param, offset in zip(self.params, self.offsets, strict=True):
                param.copy_(flat[offset : offset + param.numel()].view_as(param))

    async def _gather_flat(self, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's ``piece`` of a shard-shaped tensor, in the flat layout."""
        rows = await all_gather(self.group, piece, chunk_bytes=self.chunk_bytes)
        # Row r is segment r+1: rolling right by one segment restores the flat layout.
        return torch.roll(rows.reshape(-1), self.segment)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()

    # ------------------------------------------------------------------ state

    def shard_state(self) -> dict[str, Any]:
        """This rank's optimizer state: each entry of the inner optimizer's state for the shard
        (tensors of ``segment`` elements, or scalars such as Adam's step)."""
        return dict(self.optimizer.state.get(self.shard, {}))

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer-state tensors this rank holds (the shard's only)."""
        return sum(
            value.numel() * value.element_size()
            for value in self.shard_state().values()
            if isinstance(value, torch.Tensor)
        )

    async def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, gathered from every rank, in the form of the inner
        optimizer's ``state_dict()`` over the model's parameters (parameter i's entries shaped
        like parameter i). Collective: every rank calls it, and every rank gets it."""
        shard_state = self.shard_state()
        per_param: list[dict[str, Any]] = [{} for _ in self.params]
        for key in sorted(shard_state):
            value = shard_state[key]
            if isinstance(value, torch.Tensor) and value.shape == self.shard.shape:
                flat = await self._gather_flat(value.contiguous())
                for index, param in enumerate(self.params):
                    offset = self.offsets[index]
                    per_param[index][key] = flat[offset : offset + param.numel()].view_as(param)
            else:  # a per-tensor scalar (a step count): the same on every rank
                for entry in per_param:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        inner = self.optimizer.state_dict()
        everyone = list(range(len(self.params)))
        groups = [dict(group, params=everyone) for group in inner["param_groups"]]
        state = {index: entry for index, entry in enumerate(per_param) if entry}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full optimizer state (`state_dict`'s form, or a plain optimizer's over the
        same parameters): this rank keeps its shard's slice. No communication."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, Sequence) or len(groups) != 1:
            raise ValueError("a ZeRO-1 optimizer state needs exactly one param group")
        if list(groups[0].get("params", ())) != list(range(len(self.params))):
            raise ValueError(
                f"the state's param group lists parameters {list(groups[0].get('params', ()))}, "
                f"this optimizer has {len(self.params)}"
            )
        full: Mapping[Any, Mapping[str, Any]] = state_dict.get("state", {})
        shard_state: dict[str, Any] = {}
        keys: set[str] = set()
        for entry in full.values():
            keys |= set(entry)
        lo, hi = self.shard_bounds
        for key in sorted(keys):
            sample = next(entry[key] for entry in full.values() if key in entry)
            per_param = [full.get(index, {}).get(key) for index in range(len(self.params))]
            if _per_element(per_param, self.params):
                piece = torch.zeros(self.segment, dtype=sample.dtype)
                for index, start, stop, at in self._pieces(lo, hi):
                    value = per_param[index]
                    assert isinstance(value, torch.Tensor)
                    piece[at : at + stop - start].copy_(value.reshape(-1)[start:stop])
                shard_state[key] = piece
            else:
                shard_state[key] = sample.clone() if isinstance(sample, torch.Tensor) else sample
        inner = self.optimizer.state_dict()
        group = {key: value for key, value in groups[0].items() if key != "params"}
        inner["param_groups"] = [dict(group, params=[0])]
        inner["state"] = {0: shard_state} if shard_state else {}
        self.optimizer.load_state_dict(inner)

    def consolidated_optimizer(self, state: Mapping[str, Any]) -> torch.optim.Optimizer:
        """A plain optimizer over the model's parameters holding ``state`` (a gathered
        `state_dict`): what a checkpoint or a digest of the whole training state reads."""
        optimizer = self.optimizer_factory(self.params)
        optimizer.load_state_dict(dict(state))
        return optimizer

    async def consolidated_digest(self, model: torch.nn.Module) -> StateDigest:
        """The C-DDP-001 digest (`paramsync.actors.state.digest.state_digest`) of ``model`` with the
        whole gathered optimizer state: bitwise the digest of a plain data-parallel replica in the
        same state, and the same on every rank of the group. Collective."""
        optimizer = self.consolidated_optimizer(await self.state_dict())
        return state_digest(model, optimizer)


def _per_element(values: Sequence[object], params: Sequence[torch.Tensor]) -> bool:
    """Whether a state key holds one value per parameter element (a moment, a momentum buffer)
    rather than one per parameter (a step count): every parameter has a tensor of its own shape
    there, and some parameter is not a scalar, so the two cannot be confused.

    Raises ``ValueError`` naming the parameter when some do and some do not."""
    shaped = [
        isinstance(value, torch.Tensor) and value.shape == param.shape
        for value, param in zip(values, params, strict=True)
    ]
    if not any(param.dim() > 0 and ok for param, ok in zip(params, shaped, strict=True)):
        return False
    if not all(shaped):
        index = shaped.index(False)
        raise ValueError(
            f"optimizer state: parameter {index}'s entry is not shaped like the parameter "
            f"{tuple(params[index].shape)} while others' are"
        )
    return True
