"""Digests of a replica's training state, for the C-DDP-001 check.

A digest is SHA-256 over the exact bytes of every parameter and every optimizer-state tensor, in
a fixed order, with names and shapes mixed in, so two replicas have equal digests only if their
states are bitwise identical. Per-tensor digests let the coordinator name the first tensor that
differs.
"""

from __future__ import annotations

import hashlib

import torch

from runtime.wire import tensor_buffer

__all__ = ["StateDigest", "state_digest", "named_state"]


class StateDigest:
    """The whole-state digest and each tensor's digest, in order."""

    def __init__(self, digest: bytes, tensors: list[tuple[str, bytes]]) -> None:
        self.digest = digest
        self.tensors = tensors

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateDigest) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"StateDigest({self.digest.hex()[:16]}..., {len(self.tensors)} tensors)"


def named_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and optimizer-state tensor with a stable name, in a fixed order: what
    the digest covers and what a re-sync copies."""
    items = [(f"param/{name}", param.detach()) for name, param in model.named_parameters()]
    if optimizer is not None:
        names = {id(param): name for name, param in model.named_parameters()}
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        value = torch.tensor(value)
                    label = names.get(id(param), f"group{group_index}")
                    items.append((f"optim/{label}/{key}", value.detach()))
    return items


def state_digest(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> StateDigest:
    """Hash the model's parameters and the optimizer's state (CUDA tensors are copied to the
    host after the stream is synchronized, C-STREAMSYNC-001)."""
    whole = hashlib.sha256()
    per_tensor = []
    for name, tensor in named_state(model, optimizer):
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        one = hashlib.sha256()
        one.update(f"{name}|{list(tensor.shape)}|{tensor.dtype}|".encode())
        one.update(tensor_buffer(tensor))
        value = one.digest()
        whole.update(value)
        per_tensor.append((name, value))
    return StateDigest(whole.digest(), per_tensor)
