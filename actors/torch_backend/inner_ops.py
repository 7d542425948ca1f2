"""torch.distributed's collectives run on an inner torch group (NCCL or gloo) for the bytes.

Each function runs one collective of a ``paramsync`` group on the torch group that
`paramsync.actors.torch_backend.inner.InnerGroups` routes it to, after the paramsync coordinator
agreed on the call: it issues the call (blocking its thread, never the backend's trio loop),
waits for it and leaves the results where torch expects them. The caller's tensors are used in
place when torch's group takes them as they are (contiguous, real); otherwise a contiguous copy
travels and the result is copied back. As with torch's own groups, a call that fails leaves
unspecified values in the tensors it reduces in place; the paramsync group has then failed, and
every later call and optimizer step raises its error.

* Sum and average reduce as a sum, then the average divides in place, the same on every rank
  (`paramsync.runtime.transport.segments.divide_in_place`); the reductions every rank gets are
  bitwise alike (torch's groups reduce each element once and share the result).
* On gloo a reduce-scatter is an all-reduce and this rank's part (gloo's own needs every part
  non-empty); NCCL runs its reduce-scatter.
* CUDA tensors stay on the device: the call is issued on the stream that was current in the
  caller's thread when it called (`capture_stream`), and ``wait`` orders that stream after
  NCCL's (a stream wait, not a host synchronize).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from paramsync.actors.torch_backend.ops import check_reduce
from paramsync.runtime.transport.segments import divide_in_place

__all__ = [
    "capture_stream",
    "on_stream",
    "inner_allreduce",
    "inner_broadcast",
    "inner_allgather",
    "inner_reduce_scatter",
    "inner_alltoall",
    "inner_send",
    "inner_recv",
]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # then divided: the same on gloo and NCCL
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
"""The torch reduce op each of the backend's reduce ops runs as."""


def capture_stream(tensors: Sequence[torch.Tensor]) -> Any:
    """The CUDA stream current in the calling thread for ``tensors``' device (None for CPU
    tensors): the call is issued on it from the executor's thread."""
    for tensor in tensors:
        if tensor.device.type == "cuda":  # pragma: no cover - needs CUDA
            return torch.cuda.current_stream(tensor.device)
    return None


@contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` and its device current in this thread (nothing for None)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):  # pragma: no cover
        yield


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as torch's group takes it: itself when contiguous and real, else a
    contiguous copy (complex as its real view)."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    return flat if flat.is_contiguous() else flat.contiguous()


def _store(dest: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` into ``dest`` unless ``values`` is ``dest``'s own memory already."""
    target = torch.view_as_real(dest) if dest.is_complex() else dest
    if values.data_ptr() == target.data_ptr() and values.stride() == target.stride():
        return
    with torch.no_grad():
        target.copy_(values.reshape(target.shape))


def _wait(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


def _reduce_options(op: str) -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(_OPS[op])
    return options


def inner_allreduce(group: Any, tensors: Sequence[torch.Tensor], op: str) -> None:
    """All-reduce each tensor in place (issued one after another, then waited for)."""
    wires = [_wire(t) for t in tensors]
    for wire in wires:
        check_reduce(wire.dtype, op)
    _wait([group.allreduce([wire], _reduce_options(op)) for wire in wires])
    for tensor, wire in zip(tensors, wires, strict=True):
        if op == "avg":
            divide_in_place(wire, group.size())
        _store(tensor, wire)


def inner_broadcast(group: Any, tensors: Sequence[torch.Tensor], root: int) -> None:
    """Copy ``root``'s tensors into every rank's, in place."""
    wires = [_wire(t) for t in tensors]
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    _wait([group.broadcast([wire], options) for wire in wires])
    if group.rank() != root:
        for tensor, wire in zip(tensors, wires, strict=True):
            _store(tensor, wire)


def inner_allgather(group: Any, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
    """Gather every rank's ``tensor`` into ``outputs`` (one per rank, in rank order; none:
    nothing to gather)."""
    if not outputs:
        return
    wire = _wire(tensor).reshape(-1)
    rows = torch.empty(group.size() * wire.numel(), dtype=wire.dtype, device=wire.device)
    group._allgather_base(rows, wire).wait()
    for out, row in zip(outputs, rows.chunk(group.size()), strict=True):
        _store(out, row)


def inner_reduce_scatter(
    group: Any, route: str, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str
) -> None:
    """Reduce the ranks' ``inputs`` (one per rank) and keep this rank's part in ``output``
    (no inputs: nothing to reduce)."""
    if not inputs:
        return
    flat = torch.cat([_wire(t).reshape(-1) for t in inputs])
    check_reduce(flat.dtype, op)
    rank, sizes = group.rank(), [t.numel() for t in inputs]
    start = sum(sizes[:rank])
    if route == "nccl" and len(set(sizes)) == 1:  # pragma: no cover - needs CUDA
        part = torch.empty(sizes[rank], dtype=flat.dtype, device=flat.device)
        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp(_OPS[op])
        group._reduce_scatter_base(part, flat, options).wait()
    else:
        group.allreduce([flat], _reduce_options(op)).wait()
        part = flat[start : start + sizes[rank]]
    if op == "avg":
        divide_in_place(part, group.size())
    _store(output, part)


def inner_alltoall(
    group: Any,
    output: torch.Tensor,
    inputs: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
) -> None:
    """torch's ``all_to_all_single``: rank r's ``input_splits[p]`` rows go to rank p."""
    wire_in = _wire(inputs)
    wire_out = _wire(output)
    options = dist.AllToAllOptions()
    group.alltoall_base(wire_out, wire_in, list(output_splits), list(input_splits), options).wait()
    _store(output, wire_out)


def inner_send(group: Any, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
    """Send ``tensors`` to ``dst``, one message each (matched by ``tag``)."""
    _wait([group.send([_wire(t)], dst, tag) for t in tensors])


def inner_recv(group: Any, tensors: Sequence[torch.Tensor], src: int, tag: int) -> None:
    """Receive ``tensors`` from ``src`` (the sends with the same ``tag``)."""
    wires = [_wire(t) for t in tensors]
    _wait([group.recv([wire], src, tag) for wire in wires])
    for tensor, wire in zip(tensors, wires, strict=True):
        _store(tensor, wire)
