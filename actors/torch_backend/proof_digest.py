"""Digests of DTensor parameters replicated over a mesh dimension, and of their optimizer state.

What is compared across the replicas of one mesh dimension
(`paramsync.actors.torch_backend.proof_targets.Replicated`) is each parameter's local tensor
(an HSDP shard, a tensor-parallel LayerNorm's weight) and the local tensors of its optimizer
state (Adam's moments are DTensors placed as their parameter; a scalar step counter is taken as
it is), each hashed with XXH3-128 over its exact bytes, its name, shape and dtype mixed in as
the seed, as `paramsync.actors.state.digest` hashes a whole state. A local tensor off the CPU,
or not contiguous, is copied to the host first.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from paramsync.actors.state.digest import XXH3_NAME, StateDigest
from paramsync.runtime.protocol.wire import tensor_buffer

__all__ = ["LocalHasher"]

_digest128 = xxhash.xxh3_128_digest
_seed64 = xxhash.xxh3_64_intdigest


def _local(value: Any) -> torch.Tensor:
    """A contiguous CPU tensor of ``value``'s local part (a DTensor's), or of a scalar."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value)
    local = value.to_local() if hasattr(value, "to_local") else value
    local = local.detach()
    if local.device.type != "cpu":
        local = local.cpu()
    return local if local.is_contiguous() else local.contiguous()


class LocalHasher:
    """Digests of named DTensor parameters' local tensors and their optimizer state, step after
    step (each name's seed kept)."""

    def __init__(self) -> None:
        self._seeds: dict[tuple[str, tuple[int, ...], torch.dtype], int] = {}

    def _entry(self, name: str, value: Any) -> tuple[str, bytes]:
        tensor = _local(value)
        key = (name, tuple(tensor.shape), tensor.dtype)
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = _seed64(
                f"{name}|{list(tensor.shape)}|{tensor.dtype}|".encode()
            )
        return name, _digest128(tensor_buffer(tensor), seed)

    def digest(
        self, params: list[tuple[str, Any]], optimizer: torch.optim.Optimizer
    ) -> StateDigest:
        """The digest of ``params`` (name, parameter) and of their state in ``optimizer``."""
        entries = []
        states = optimizer.state
        with torch.no_grad():
            for name, param in params:
                entries.append(self._entry(f"param/{name}", param))
                state = states.get(param)
                if state:
                    for key in sorted(state):
                        entries.append(self._entry(f"optim/{name}/{key}", state[key]))
        return StateDigest(None, entries, algorithm=XXH3_NAME)
