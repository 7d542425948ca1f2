"""torch.distributed's collectives written with paramsync's (`paramsync.runtime.collectives`).

Each function runs one torch collective on a paramsync `Transport` (the group's own
authenticated mesh), in the trio loop, and leaves the results where torch expects them (the
caller's tensors, in place). Every rank ends with bitwise the same result:

* sum and average go through the ring (`paramsync.runtime.collectives.ring.all_reduce`: a fixed
  summation order, the same on every rank);
* the other reduce ops (product, min, max and the bitwise ones) gather every rank's tensor and
  fold them in rank order on every rank;
* reduce-scatter with sum or average reduces with the ring and keeps this rank's part;
* CUDA tensors are staged through host memory (copied to the CPU, reduced, copied back);
* sum and average land in a buffer of the group's, reused from call to call (the largest one
  a group used is kept): the ring leaves unspecified bytes on failure, so never in the
  caller's memory, and a fresh buffer per call would cost its page faults every time (for
  tensors above glibc's 32 MiB mmap threshold, about 0.5 ms of CPU per MiB, 33 ms for 64 MiB).

Complex tensors are reduced as their real view (sum, average); a dtype the wire cannot carry
is an `UnsupportedCall` naming it.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager

import torch

from paramsync.actors.torch_backend.calls import UnsupportedCall
from paramsync.runtime.collectives.p2p import post_recv, post_send
from paramsync.runtime.collectives.p2p import recv as p2p_recv
from paramsync.runtime.collectives.p2p import send as p2p_send
from paramsync.runtime.collectives.ring import all_gather, all_reduce, barrier, broadcast
from paramsync.runtime.errors import CollectiveError, ProtocolError
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.segments import SUPPORTED_DTYPES

__all__ = [
    "allreduce_op",
    "broadcast_op",
    "sparse_allreduce_op",
    "allgather_op",
    "reduce_scatter_op",
    "alltoall_op",
    "barrier_op",
    "send_op",
    "recv_op",
    "check_dtype",
    "check_reduce",
]


def check_dtype(tensor: torch.Tensor, op: str) -> None:
    """Refuse a tensor the wire cannot carry, naming its dtype and the op."""
    dtype = tensor.dtype
    if dtype.is_complex:
        dtype = torch.view_as_real(tensor[:0] if tensor.dim() else tensor.reshape(1)).dtype
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise UnsupportedCall(
            f"{op}: dtype {str(tensor.dtype).removeprefix('torch.')} is not supported by the "
            f"paramsync backend (supported: {supported})"
        )


def check_reduce(dtype: torch.dtype, op: str) -> None:
    """Refuse a reduction the backend does not run on ``dtype`` (a tensor as the wire carries
    it: complex as its real view), naming it and what to do instead."""
    name = str(dtype).removeprefix("torch.")
    if op == "avg" and not dtype.is_floating_point:
        raise UnsupportedCall(
            f"allreduce(avg) of {name}: average floating point tensors, or sum and divide"
        )
    if op in ("sum", "avg") and dtype == torch.bool:
        raise UnsupportedCall("allreduce(sum) of bool: use MAX (any) or MIN (all)")
    if op in ("band", "bor", "bxor") and dtype.is_floating_point:
        raise UnsupportedCall(f"allreduce({op}) of {dtype}: bitwise ops take integers")


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor holding ``tensor``'s values (complex as its real view)."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    if flat.device.type != "cpu":
        return flat.to("cpu").contiguous()
    return flat.contiguous()


def _scratch(tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` (``tensor`` as `_host` gives it) as a buffer a collective may land in: a copy
    when it is the caller's memory, else ``host`` itself (`_host` already copied it)."""
    if _copied(tensor, host):
        return host
    return host.clone()


def _copied(tensor: torch.Tensor, host: torch.Tensor) -> bool:
    """Whether ``host`` is memory of its own, not ``tensor``'s (a CUDA or strided tensor's)."""
    return (
        tensor.device != host.device
        or tensor.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    )


_SPARE: weakref.WeakKeyDictionary[Transport, torch.Tensor] = weakref.WeakKeyDictionary()
"""Each group's landing buffer between calls (bytes; taken out while a call uses it)."""


@contextmanager
def _landing(group: Transport, dtype: torch.dtype, numel: int) -> Iterator[torch.Tensor]:
    """An uninitialised 1-D buffer of ``numel`` ``dtype`` elements for ``group``'s collective
    to land in: the group's spare one when it is large enough (a call running meanwhile on the
    same group gets one of its own), kept for the next call afterwards."""
    nbytes = numel * dtype.itemsize
    buffer = _SPARE.pop(group, None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    try:
        yield buffer[:nbytes].view(dtype)
    finally:
        spare = _SPARE.get(group)
        if spare is None or spare.numel() < buffer.numel():
            _SPARE[group] = buffer


def _store(dest: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (a host tensor of ``dest``'s element count) into ``dest``."""
    with torch.no_grad():
        if dest.is_complex():
            torch.view_as_real(dest).copy_(values.view(torch.view_as_real(dest).shape))
        else:
            dest.copy_(values.view(dest.shape))


def _fold(rows: torch.Tensor, op: str) -> torch.Tensor:
    """Fold the gathered ``rows`` (rank r's tensor in row r) in rank order."""
    out = rows[0].clone()
    for row in rows[1:]:
        if op == "product":
            out.mul_(row)
        elif op == "min":
            torch.minimum(out, row, out=out)
        elif op == "max":
            torch.maximum(out, row, out=out)
        elif op == "band":
            out.bitwise_and_(row)
        elif op == "bor":
            out.bitwise_or_(row)
        elif op == "bxor":
            out.bitwise_xor_(row)
        else:  # pragma: no cover - the callers pass only these
            raise UnsupportedCall(f"reduce op {op} cannot be folded")
    return out


async def _reduce(
    group: Transport, flat: torch.Tensor, op: str, work: torch.Tensor
) -> torch.Tensor:
    """``flat`` reduced across the group by ``op``: sum and average in ``work`` (a buffer of
    ``flat``'s size that no caller holds, or ``flat`` itself when it is such a buffer; ``flat``
    is copied into it), the other ops in a new tensor."""
    check_reduce(flat.dtype, op)
    if op in ("sum", "avg"):
        # The ring leaves unspecified bytes on failure: never in the caller's memory.
        if work.data_ptr() != flat.data_ptr():
            work.copy_(flat)
        await all_reduce(group, work, op)  # type: ignore[arg-type]
        return work
    rows = await all_gather(group, flat)
    return _fold(rows, op)


async def allreduce_op(group: Transport, tensors: Sequence[torch.Tensor], op: str) -> None:
    """All-reduce each tensor in place (the coalesced form reduces them as one)."""
    if not tensors:
        return
    hosts = [_host(t) for t in tensors]
    if len(hosts) > 1 and len({h.dtype for h in hosts}) == 1:
        parts = [h.view(-1) for h in hosts]
        with _landing(group, parts[0].dtype, sum(p.numel() for p in parts)) as work:
            torch.cat(parts, out=work)
            reduced = await _reduce(group, work, op, work)
            offset = 0
            for tensor, host in zip(tensors, hosts, strict=True):
                n = host.numel()
                _store(tensor, reduced[offset : offset + n])
                offset += n
        return
    for tensor, host in zip(tensors, hosts, strict=True):
        flat = host.view(-1)
        if _copied(tensor, host):  # already a copy of its own: land in it
            _store(tensor, await _reduce(group, flat, op, flat))
            continue
        with _landing(group, flat.dtype, flat.numel()) as work:
            _store(tensor, await _reduce(group, flat, op, work))


async def sparse_allreduce_op(group: Transport, tensor: torch.Tensor) -> None:
    """Sum a sparse COO ``tensor`` across the group, in place (gloo's sparse all-reduce): each
    rank's entries are gathered (the ranks' entry counts first, then every rank's indices and
    values, padded to the largest count) and added in rank order on every rank, so every rank
    ends with bitwise the same coalesced sum."""
    mine = tensor.detach().coalesce()
    indices, values = mine.indices(), mine.values()
    counts = await all_gather(group, torch.tensor([indices.shape[1]], dtype=torch.int64))
    sizes = [int(c) for c in counts.view(-1)]
    most = max(sizes)
    total = torch.sparse_coo_tensor(
        indices[:, :0], values[:0], tensor.shape, dtype=values.dtype
    ).coalesce()
    if most:
        padded_indices = indices.new_zeros((indices.shape[0], most))
        padded_indices[:, : sizes[group.rank]] = indices
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: sizes[group.rank]] = values
        all_indices = await all_gather(group, padded_indices.reshape(-1))
        all_values = await all_gather(group, _host(padded_values).reshape(-1))
        for rank, size in enumerate(sizes):
            rank_indices = all_indices[rank].view(indices.shape[0], most)[:, :size]
            rank_values = _values_of(all_values[rank], padded_values)[:size]
            total = total + torch.sparse_coo_tensor(rank_indices, rank_values, tensor.shape)
    with torch.no_grad():
        tensor.copy_(total.coalesce())


def _values_of(row: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """A gathered row of values (flat, complex as its real view) in ``padded``'s shape."""
    if padded.is_complex():
        return torch.view_as_complex(row.view(*padded.shape, 2))
    return row.view(padded.shape)


async def broadcast_op(group: Transport, tensors: Sequence[torch.Tensor], root: int) -> None:
    """Copy ``root``'s tensors into every rank's, in place."""
    for tensor in tensors:
        # The ring's broadcast lands the parts in a scratch of its own and writes the
        # destination once all passed their tags, so the caller's memory needs no copy here.
        host = _host(tensor).view(-1)
        await broadcast(group, host, root)
        if group.rank != root and _copied(tensor, host):
            _store(tensor, host)


async def allgather_op(
    group: Transport, outputs: Sequence[torch.Tensor], tensor: torch.Tensor
) -> None:
    """Gather every rank's ``tensor`` into ``outputs`` (one per rank, in rank order)."""
    rows = await all_gather(group, _host(tensor).view(-1))
    for rank, out in enumerate(outputs):
        _store(out, rows[rank])


async def reduce_scatter_op(
    group: Transport, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str
) -> None:
    """Reduce the ranks' ``inputs`` (one per rank) and keep this rank's part in ``output``."""
    hosts = [_host(t) for t in inputs]
    flat = torch.cat([h.view(-1) for h in hosts])
    reduced = await _reduce(group, flat, op, flat)
    sizes = [h.numel() for h in hosts]
    start = sum(sizes[: group.rank])
    _store(output, reduced[start : start + sizes[group.rank]])


async def alltoall_op(
    group: Transport,
    output: torch.Tensor,
    inputs: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
) -> None:
    """Rank r sends its ``input_splits[p]``-row slice p to rank p, which keeps it as its
    slice r of ``output`` (torch's ``all_to_all_single``; empty splits: equal rows)."""
    n, me = group.world_size, group.rank
    source = _host(inputs)
    rows_in = _splits(source.shape[0] if source.dim() else 0, input_splits, n, "input")
    rows_out = _splits(output.shape[0] if output.dim() else 0, output_splits, n, "output")
    gathered = _scratch(output, _host(output))  # complex: its real view, as ``source``
    row_elems = source[0].numel() if source.dim() and source.shape[0] else 0
    out_row = gathered[0].numel() if gathered.dim() and gathered.shape[0] else 0
    flat_in, flat_out = source.view(-1), gathered.view(-1)
    starts_in = [sum(rows_in[:p]) for p in range(n)]
    starts_out = [sum(rows_out[:p]) for p in range(n)]
    # Pairwise exchange in a fixed order: in round k rank r sends to r+k and receives from r-k.
    mine = flat_in[starts_in[me] * row_elems : (starts_in[me] + rows_in[me]) * row_elems]
    flat_out[starts_out[me] * out_row : (starts_out[me] + rows_out[me]) * out_row].copy_(mine)
    for k in range(1, n):
        dst, src = (me + k) % n, (me - k) % n
        part = flat_in[starts_in[dst] * row_elems : (starts_in[dst] + rows_in[dst]) * row_elems]
        land = flat_out[starts_out[src] * out_row : (starts_out[src] + rows_out[src]) * out_row]
        # Lower rank of each pair sends first, so no pair waits on itself.
        if me < dst:
            await p2p_send(group, part.contiguous(), dst, tag=k)
        incoming = land.clone()
        try:
            await p2p_recv(group, incoming, src, tag=k)
        except ProtocolError as exc:
            raise CollectiveError(
                f"all_to_all_single: rank {src} sends this rank (rank {me}) a part that is not "
                f"the {rows_out[src]} row(s) of output_split_sizes[{src}] here "
                f"(its input_split_sizes[{me}] must equal this rank's "
                f"output_split_sizes[{src}]): {exc}"
            ) from None
        land.copy_(incoming)
        if me >= dst:
            await p2p_send(group, part.contiguous(), dst, tag=k)
    _store(output, gathered)


def _splits(rows: int, splits: Sequence[int], n: int, what: str) -> list[int]:
    if not splits:
        if rows % n:
            raise UnsupportedCall(
                f"alltoall: {rows} {what} rows do not split equally among {n} ranks"
            )
        return [rows // n] * n
    if len(splits) != n or sum(splits) != rows:
        raise UnsupportedCall(
            f"alltoall: {what} splits {list(splits)} do not give {rows} rows to {n} ranks"
        )
    return [int(s) for s in splits]


async def barrier_op(group: Transport) -> None:
    """Return once every rank of the group has entered the barrier."""
    await barrier(group)


def send_op(
    group: Transport, tensors: Sequence[torch.Tensor], dst: int, tag: int
) -> Awaitable[None]:
    """Post a send of each of ``tensors`` to ``dst`` now (matched by ``tag`` at the
    receiver; sends to one peer leave in posting order); await the result to complete them.
    The tensors are copied as they are now: the caller may change them meanwhile."""
    posted = [post_send(group, _scratch(t, _host(t)), dst, tag) for t in tensors]

    async def complete() -> None:
        for send in posted:
            await send()

    return complete()


def recv_op(
    group: Transport, tensors: Sequence[torch.Tensor], src: int, tag: int
) -> Awaitable[None]:
    """Post a receive into each of ``tensors`` from ``src`` now (the sends with the same
    ``tag``, in their order): a message that arrives from this moment on matches it, whatever
    this rank posts or waits for meanwhile (an ``irecv`` posted before its ``isend``). Await
    the result to complete them."""
    hosts = [_scratch(t, _host(t)) for t in tensors]
    posted = [post_recv(group, host, src, tag) for host in hosts]

    async def complete() -> None:
        for tensor, host, recv in zip(tensors, hosts, posted, strict=True):
            await recv()
            _store(tensor, host)

    return complete()
