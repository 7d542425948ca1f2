"""`ProcessGroupParamsync`: a torch.distributed process group whose collectives run on paramsync.

``torch.distributed.init_process_group("paramsync")`` (and ``new_group(backend="paramsync")``)
makes one per group through the factory `create_process_group`, registered at ``import torch``
by `paramsync.torch_entry` (which imports this module at the first group). torch then runs
everything on it: its DDP (parameter checks, the broadcast of rank 0's state, every gradient
bucket), ``all_reduce`` and friends, and the frameworks built on them (Lightning, Accelerate, the
transformers Trainer).

Each collective returns a torch `Work` at once; the group's `GroupSession` runs it in the
backend's trio loop after the coordinator has seen that every member calls the same thing
(`paramsync.actors.torch_backend.calls`), and completes the work's future with the result or with
one error naming what went wrong. An operation this backend does not run raises `UnsupportedCall`
naming it.

The bytes of a call move on paramsync's own mesh (`paramsync.actors.torch_backend.ops`), or,
for the calls the group's inner torch group takes (`paramsync.actors.torch_backend.inner`: NCCL
for CUDA tensors by default, gloo for CPU tensors when asked), through that group
(`paramsync.actors.torch_backend.inner_ops`), after the same agreement.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from paramsync.actors.torch_backend.calls import Call, UnsupportedCall, reduce_op_name
from paramsync.actors.torch_backend.inner import InnerGroups, inner_kind
from paramsync.actors.torch_backend.inner_ops import (
    capture_stream,
    inner_allgather,
    inner_allreduce,
    inner_alltoall,
    inner_broadcast,
    inner_recv,
    inner_reduce_scatter,
    inner_send,
    on_stream,
)
from paramsync.actors.torch_backend.monitored import install as install_monitored_barrier
from paramsync.actors.torch_backend.monitored import monitored_barrier_op, seconds_of
from paramsync.actors.torch_backend.not_parallel import watch_parallel
from paramsync.actors.torch_backend.ops import (
    allgather_op,
    allreduce_op,
    alltoall_op,
    barrier_op,
    broadcast_op,
    check_dtype,
    recv_op,
    reduce_scatter_op,
    send_op,
    sparse_allreduce_op,
)
from paramsync.actors.torch_backend.proof import proof_enabled, watch_group
from paramsync.actors.torch_backend.session import (
    COORDINATOR_KEY,
    BackendError,
    GroupSession,
    SessionOptions,
    _Op,
)
from paramsync.actors.torch_backend.tree import TreeLayout
from paramsync.actors.torch_backend.tree import decide as decide_layout
from paramsync.runtime.config import advertised_host, parse_address
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.protocol.handshake import load_secret
from paramsync.runtime.transport.base import Transport

__all__ = ["ProcessGroupParamsync", "create_process_group", "BACKEND_NAME"]

log = logging.getLogger(__name__)

BACKEND_NAME = "paramsync"

COORDINATOR_ENV = "PARAMSYNC_COORDINATOR_ADDR"
"""Set by ``paramsync launch``: the coordinator it runs for the job. The world group joins it;
every other group's rank 0 hosts the group's own coordinator."""

HEARTBEAT_ENV = "PARAMSYNC_HEARTBEAT_DEADLINE"
"""Seconds of silence after which a group's coordinator declares a rank lost (default 10)."""


def _coordinator_host() -> str:
    """Where rank 0's coordinator listens: $PARAMSYNC_ADVERTISE_ADDR, else MASTER_ADDR (the
    host torchrun and ``paramsync launch`` name for rank 0), else loopback."""
    return advertised_host() or os.environ.get("MASTER_ADDR", "").strip() or "127.0.0.1"


_GENERATIONS: dict[str, int] = {}
_GENERATIONS_LOCK = threading.Lock()


def _coordinator_key(name: str) -> str:
    """The store key of this group's coordinator address: one per group this process made
    under ``name``. torch names the default group "0" again after ``destroy_process_group``,
    in the same store (torchrun's), so a second ``init_process_group("paramsync")`` in one
    job would otherwise read the first group's address, a coordinator that is gone. Every
    rank makes the same groups in the same order, so the numbers agree."""
    with _GENERATIONS_LOCK:
        generation = _GENERATIONS.get(name, 0)
        _GENERATIONS[name] = generation + 1
    return COORDINATOR_KEY if generation == 0 else f"{COORDINATOR_KEY}/{generation}"


def _publish(store: Any, key: str, address: tuple[str, int]) -> None:
    store.set(key, f"{address[0]} {address[1]}")


def _read(store: Any, key: str, seconds: float) -> tuple[str, int]:
    store.wait([key], timedelta(seconds=seconds))
    host, port_text = store.get(key).decode().rsplit(" ", 1)
    return host, int(port_text)


def _join_tree(
    session: GroupSession, store: Any, key: str, layout: TreeLayout, seconds: float
) -> tuple[str, int]:
    """The coordinator tree (`paramsync.actors.torch_backend.tree`): rank 0 hosts the root
    (its address under ``key``), each host's first rank the host's sub-coordinator (its
    address under ``key/host/<index>``); returns the address of this rank's host's."""
    if layout.rank == 0:
        _publish(store, key, session.host_root(layout))
    sub_key = f"{key}/host/{layout.index}"
    if layout.first:
        address = session.host_sub(layout, _read(store, key, seconds))
        _publish(store, sub_key, address)
        return address
    session.layout = layout
    return _read(store, sub_key, seconds)


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, timedelta):
        return max(1.0, timeout.total_seconds())
    return 1800.0


def create_process_group(options: Any, backend_options: Any = None) -> ProcessGroupParamsync:
    """torch's factory for the ``paramsync`` backend (``extended_api=True``): ``options``
    carries the group's store, rank, size, timeout, name and global ranks; ``backend_options``
    is the ``pg_options`` of ``init_process_group``/``new_group``: the inner torch group to
    use (`paramsync.actors.torch_backend.inner.inner_kind`)."""
    kind = inner_kind(backend_options)
    try:
        secret = load_secret()
    except ValueError as exc:
        raise ConfigError(
            f"init_process_group('paramsync'): {exc} (the secret never travels through "
            "torch's store: every rank needs it in its environment)"
        ) from None
    heartbeat = os.environ.get(HEARTBEAT_ENV, "").strip()
    try:
        heartbeat_deadline = float(heartbeat) if heartbeat else 10.0
    except ValueError:
        raise ConfigError(f"{HEARTBEAT_ENV}={heartbeat!r} is not a number of seconds") from None
    session_options = SessionOptions(
        timeout_seconds=_seconds(options.timeout),
        heartbeat_deadline=heartbeat_deadline,
        host=_coordinator_host(),
        inner=kind,
    )
    hosted: tuple[str, int] | None = None
    launched = os.environ.get(COORDINATOR_ENV, "").strip()
    if launched and not options.global_ranks_in_group:  # the world group, under the launcher
        try:
            hosted = parse_address(launched)
        except ValueError as exc:
            raise ConfigError(f"{COORDINATOR_ENV}: {exc}") from None
    return ProcessGroupParamsync(
        options.store,
        options.group_rank,
        options.group_size,
        name=str(options.group_id),
        global_ranks=tuple(options.global_ranks_in_group),
        secret=secret,
        options=session_options,
        coordinator=hosted,
    )


class ParamsyncWork(dist._Work):
    """The `Work` of one call: ``wait()`` blocks until it ran and raises the group's error if
    it failed (torch's work made from a future swallows the error), ``get_future()`` is the
    call's future (what torch DDP's reducer and comm hooks chain on)."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises the call's error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:
        try:
            self._future.value()
        except Exception as exc:
            return exc
        return None


def _work(future: torch.futures.Future[Any]) -> Any:
    return ParamsyncWork(future)


class ProcessGroupParamsync(dist.ProcessGroup):
    """A torch process group on paramsync: every collective sequenced by the group's
    coordinator, run on its authenticated mesh, bitwise identical on every rank."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        name: str,
        global_ranks: Sequence[int] = (),
        secret: bytes,
        options: SessionOptions,
        coordinator: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) form
        self._rank, self._size = rank, size
        self._group_name = name
        self.global_ranks = tuple(global_ranks) or tuple(range(size))
        self.calls_by_plane: collections.Counter[str] = collections.Counter()
        """How many calls went to each plane: ``native`` (paramsync's mesh), ``gloo``,
        ``nccl`` (the inner torch group)."""
        self.session = GroupSession(
            name, rank, size, secret, options, launched=coordinator is not None
        )
        self.session.global_ranks = self.global_ranks
        key = _coordinator_key(name)
        seconds = options.timeout_seconds
        if coordinator is not None:  # ``paramsync launch`` runs the world's coordinator
            address = coordinator
        else:
            layout = decide_layout(store, key, name, rank, size, seconds)
            if layout is not None:
                address = _join_tree(self.session, store, key, layout, seconds)
            elif rank == 0:
                address = self.session.host_coordinator()
                _publish(store, key, address)
            else:
                address = _read(store, key, seconds)
        self.session.open(address)
        if options.inner != "native":
            try:
                self.session.inner = InnerGroups(
                    options.inner,
                    store,
                    rank,
                    size,
                    timedelta(seconds=options.timeout_seconds),
                    prefix=f"{key}/inner/",
                )
            except RuntimeError as exc:  # gloo's connections, within the group's timeout
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise BackendError(
                    f"paramsync group {name}, rank {rank}: its inner {options.inner} group did "
                    f"not form within {options.timeout_seconds:g} s: {first}"
                ) from None
        watch_group(self, prove=proof_enabled())
        self.parallel_watch = watch_parallel(name, rank, size)  # refuses a run never reducing

    # ------------------------------------------------------------------ identity

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def _backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        """torch's name for the group (its group id). torch's own reads it from a C++
        backend registered on the group, which a Python process group has none of."""
        return self._group_name

    def __repr__(self) -> str:
        group, rank, size = self._group_name, self._rank, self._size
        return f"ProcessGroupParamsync(group {group!r}, rank {rank} of {size})"

    # ------------------------------------------------------------------ plumbing

    def _submit(
        self,
        call: Call,
        run: Callable[[Transport], Any],
        result: Any,
        *,
        p2p: bool = False,
        inner: tuple[str, Callable[[], None]] | None = None,
    ) -> Any:
        """Queue ``call``: ``run`` on paramsync's mesh, or, with ``inner`` (from `_inner`: the
        plane and the call on it), on the inner torch group, the plane named in the call the
        members must agree on."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        on_inner = None
        if inner is not None:
            plane, on_inner = inner
            call = replace(call, plane=plane)
        self.parallel_watch.saw(call.op)
        self.session.submit(_Op(call, run, future, result, p2p=p2p, inner=on_inner))
        return _work(future)

    def _inner(
        self,
        tensors: Sequence[torch.Tensor],
        run: Callable[[Any, str], None],
        planes: tuple[str, ...] = ("nccl", "gloo"),
    ) -> tuple[str, Callable[[], None]] | None:
        """``run(torch_group, route)`` as a call on the inner group that takes ``tensors``
        (issued on the caller's current CUDA stream), with its route (one of ``planes``), or
        None: the call runs on the native plane."""
        groups = self.session.inner
        route = groups.route(tensors) if groups is not None else None
        if route not in planes:
            route = None
        self.calls_by_plane[route or "native"] += 1
        if groups is None or route is None:
            return None
        stream = capture_stream(tensors)

        def call() -> None:
            with on_stream(stream):
                run(groups.group(route), route)

        return route, call

    def _check(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.layout != torch.strided:
                raise UnsupportedCall(
                    f"{op} of a {tensor.layout} tensor: the paramsync backend takes dense "
                    "tensors here (all_reduce with SUM also takes a sparse COO tensor)"
                )
            check_dtype(tensor, op)
        if self.session.failure is not None:
            raise self.session.failure

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        if any(t.layout != torch.strided for t in tensors):
            return self._sparse_allreduce(tensors, op)
        self._check("allreduce", tensors)
        call = Call.of("allreduce", tensors, op)
        inner = self._inner(tensors, lambda group, _: inner_allreduce(group, tensors, op))
        return self._submit(call, partial(_allreduce, tensors, op), tensors, inner=inner)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str) -> Any:
        """All-reduce of one sparse COO tensor with SUM, as gloo runs it (on the native plane)."""
        (tensor,) = tensors if len(tensors) == 1 else (None,)
        if tensor is None or tensor.layout != torch.sparse_coo or op != "sum":
            raise UnsupportedCall(
                f"allreduce of sparse tensors ({tensors[0].layout}, {op.upper()}): the paramsync "
                "backend reduces one sparse COO tensor with SUM (as gloo does)"
            )
        if tensor.device.type != "cpu":
            raise UnsupportedCall(
                f"allreduce of a sparse tensor on {tensor.device}: the paramsync backend "
                "reduces sparse tensors on the CPU (move it with .cpu())"
            )
        check_dtype(tensor, "allreduce")
        if self.session.failure is not None:
            raise self.session.failure
        self.calls_by_plane["native"] += 1
        call = Call.of("allreduce", tensors, "sum, sparse")
        return self._submit(call, partial(sparse_allreduce_op, tensor=tensor), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        self._check("allreduce_coalesced", tensors)
        call = Call.of("allreduce_coalesced", tensors, op)
        inner = self._inner(tensors, lambda group, _: inner_allreduce(group, tensors, op))
        return self._submit(call, partial(_allreduce, tensors, op), tensors, inner=inner)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        if opts is not None and int(getattr(opts, "rootTensor", 0)) != 0:
            raise UnsupportedCall("broadcast: only root_tensor=0 is supported")
        self._check("broadcast", tensors)
        call = Call.of("broadcast", tensors, f"root {root}")
        inner = self._inner(tensors, lambda group, _: inner_broadcast(group, tensors, root))
        return self._submit(call, partial(_broadcast, tensors, root), tensors, inner=inner)

    def allgather(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        if len(inputs) != 1 or len(output_lists) != 1:
            raise UnsupportedCall("allgather: one input tensor per rank (one device per process)")
        outputs = output_lists[0]
        self._check_gather("allgather", outputs, inputs[0])
        call = Call.of("allgather", inputs)
        inner = self._inner(
            [inputs[0], *outputs], lambda group, _: inner_allgather(group, outputs, inputs[0])
        )
        run = partial(_allgather, outputs, inputs[0])
        return self._submit(call, run, output_lists, inner=inner)

    def _check_gather(self, op: str, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        self._check(op, [tensor])
        if len(outputs) != self._size:
            raise ValueError(f"{op}: {len(outputs)} output tensors for a group of {self._size}")
        for out in outputs:
            if out.numel() != tensor.numel() or out.dtype != tensor.dtype:
                raise ValueError(
                    f"{op}: output {list(out.shape)} {out.dtype} does not match the input "
                    f"{list(tensor.shape)} {tensor.dtype}"
                )

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        if output.numel() != tensor.numel() * self._size:
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, needs "
                f"{tensor.numel() * self._size} ({self._size} x {tensor.numel()})"
            )
        rows = list(output.view(-1).chunk(self._size)) if output.numel() else []
        self._check("all_gather_into_tensor", [tensor])
        call = Call.of("allgather_into_tensor", [tensor])
        inner = self._inner([tensor, output], lambda group, _: inner_allgather(group, rows, tensor))
        run = partial(_allgather_flat, output, rows, tensor)
        return self._submit(call, run, output, inner=inner)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._check("allgather_into_tensor_coalesced", inputs)
        call = Call.of("allgather_into_tensor_coalesced", inputs)

        async def run(group: Transport) -> None:
            for output, tensor in zip(outputs, inputs, strict=True):
                rows = list(output.view(-1).chunk(self._size))
                await _allgather_flat(output, rows, tensor, group)

        def run_inner(group: Any, route: str) -> None:
            for output, tensor in zip(outputs, inputs, strict=True):
                if output.numel():
                    inner_allgather(group, list(output.view(-1).chunk(self._size)), tensor)

        inner = self._inner([*inputs, *outputs], run_inner)
        return self._submit(call, run, outputs, inner=inner)

    def reduce_scatter(
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        if len(outputs) != 1 or len(input_lists) != 1:
            raise UnsupportedCall("reduce_scatter: one output tensor per rank")
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        inputs = input_lists[0]
        if len(inputs) != self._size:
            raise ValueError(f"reduce_scatter: {len(inputs)} inputs for a group of {self._size}")
        self._check("reduce_scatter", [*inputs, outputs[0]])
        call = Call.of("reduce_scatter", inputs, op)
        inner = self._inner(
            [*inputs, outputs[0]],
            lambda group, route: inner_reduce_scatter(group, route, outputs[0], inputs, op),
        )
        run = partial(_reduce_scatter, outputs[0], inputs, op)
        return self._submit(call, run, outputs, inner=inner)

    def _reduce_scatter_base(
        self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None
    ) -> Any:
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        if tensor.numel() != output.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {tensor.numel()} elements, needs "
                f"{output.numel() * self._size} ({self._size} x {output.numel()})"
            )
        self._check("reduce_scatter_tensor", [tensor, output])
        inputs = list(tensor.reshape(-1).chunk(self._size)) if tensor.numel() else []
        call = Call.of("reduce_scatter_tensor", [tensor], op)
        inner = self._inner(
            [tensor, output],
            lambda group, route: inner_reduce_scatter(group, route, output, inputs, op),
        )
        run = partial(_reduce_scatter, output, inputs, op)
        return self._submit(call, run, output, inner=inner)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        self._check("reduce_scatter_tensor_coalesced", inputs)
        call = Call.of("reduce_scatter_tensor_coalesced", inputs, op)

        async def run(group: Transport) -> None:
            for output, tensor in zip(outputs, inputs, strict=True):
                parts = list(tensor.reshape(-1).chunk(self._size))
                await _reduce_scatter(output, parts, op, group)

        def run_inner(group: Any, route: str) -> None:
            for output, tensor in zip(outputs, inputs, strict=True):
                if tensor.numel():
                    parts = list(tensor.reshape(-1).chunk(self._size))
                    inner_reduce_scatter(group, route, output, parts, op)

        inner = self._inner([*inputs, *outputs], run_inner)
        return self._submit(call, run, outputs, inner=inner)

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        self._check("all_to_all_single", [tensor, output])
        # Each rank's splits are its own (rank i sends rank j what rank j expects from i, which
        # the exchange checks pair by pair): the members agree on the rows' shape and dtype.
        rows = [t.new_empty((0, *t.shape[1:])) if t.dim() else t for t in (tensor, output)]
        call = Call.of("alltoall", rows, "uneven" if input_splits or output_splits else "even")
        run = partial(_alltoall, output, tensor, list(output_splits), list(input_splits))
        inner = self._inner(
            [tensor, output],
            lambda group, _: inner_alltoall(group, output, tensor, output_splits, input_splits),
        )
        return self._submit(call, run, output, inner=inner)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._check("all_to_all", [*inputs, *outputs])
        if len(inputs) != self._size or len(outputs) != self._size:
            raise ValueError(f"all_to_all: needs {self._size} input and output tensors")
        call = Call.of("alltoall_list", inputs)

        async def run(group: Transport) -> None:
            source = torch.cat([t.reshape(-1) for t in inputs])
            dest = torch.empty(sum(o.numel() for o in outputs), dtype=source.dtype)
            await alltoall_op(
                group, dest, source, [o.numel() for o in outputs], [t.numel() for t in inputs]
            )
            offset = 0
            for out in outputs:
                with torch.no_grad():
                    out.copy_(dest[offset : offset + out.numel()].view(out.shape))
                offset += out.numel()

        def run_inner(group: Any, route: str) -> None:
            source = torch.cat([t.reshape(-1) for t in inputs])
            dest = source.new_empty(sum(o.numel() for o in outputs))
            sizes_out, sizes_in = [o.numel() for o in outputs], [t.numel() for t in inputs]
            inner_alltoall(group, dest, source, sizes_out, sizes_in)
            for out, part in zip(outputs, dest.split(sizes_out), strict=True):
                with torch.no_grad():
                    out.copy_(part.view(out.shape))

        inner = self._inner([*inputs, *outputs], run_inner)
        return self._submit(call, run, outputs, inner=inner)

    def barrier(self, opts: Any = None) -> Any:
        if self.session.failure is not None:
            raise self.session.failure
        self.calls_by_plane["native"] += 1  # no bytes: the native plane's own barrier
        return self._submit(Call("barrier", "", ()), barrier_op, None)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        self._check("send", tensors)
        call = Call.of("send", tensors, f"to {dst} tag {tag}")
        run = partial(send_op, tensors=tensors, dst=dst, tag=tag)  # posted when it is its turn

        # gloo sends once the receiver has posted its receive, which would hold the executor
        # (an isend before its irecv): point-to-point stays on the native plane but on NCCL.
        run_inner = partial(inner_send, tensors=tensors, dst=dst, tag=tag)
        inner = self._inner(tensors, lambda group, _: run_inner(group), planes=("nccl",))
        return self._submit(call, run, tensors, p2p=True, inner=inner)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        self._check("recv", tensors)
        call = Call.of("recv", tensors, f"from {src} tag {tag}")
        run = partial(recv_op, tensors=tensors, src=src, tag=tag)  # posted when it is its turn

        run_inner = partial(inner_recv, tensors=tensors, src=src, tag=tag)
        inner = self._inner(tensors, lambda group, _: run_inner(group), planes=("nccl",))
        return self._submit(call, run, tensors, p2p=True, inner=inner)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier`` (`paramsync.actors.torch_backend.monitored`): rank 0
        names the ranks that did not arrive within ``timeout`` (default: the group's); blocks
        until this rank's part is done."""
        if self.session.failure is not None:
            raise self.session.failure
        seconds = self.session.options.timeout_seconds if timeout is None else seconds_of(timeout)
        where = f"paramsync group {self._group_name}, rank {self._rank}"
        call = Call("monitored_barrier", f"timeout {seconds:g} s", ())
        run = partial(
            monitored_barrier_op, seconds=seconds, wait_all_ranks=wait_all_ranks, where=where
        )
        self.calls_by_plane["native"] += 1
        future: torch.futures.Future[Any] = torch.futures.Future()
        self.session.submit(_Op(call, run, future, None, p2p=True, own_verdict=True))
        future.wait()

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise UnsupportedCall(
            "recv without a source (recv_anysource) is not supported by the paramsync "
            "backend: name the source rank"
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        root = int(opts.rootRank) if opts is not None else 0
        self._check("reduce", tensors)
        call = Call.of("reduce", tensors, f"{op} root {root}")
        keep = [t if self._rank == root else t.detach().clone() for t in tensors]

        async def run(group: Transport) -> None:
            await allreduce_op(group, keep, op)

        inner = self._inner(keep, lambda group, _: inner_allreduce(group, keep, op))
        return self._submit(call, run, tensors, inner=inner)

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        self._check("gather", inputs)
        call = Call.of("gather", inputs, f"root {root}")
        outputs = output_lists[0] if output_lists else []
        tensor = inputs[0]

        async def run(group: Transport) -> None:
            rows = [torch.empty_like(tensor) for _ in range(self._size)]
            await allgather_op(group, rows, tensor)
            keep(rows)

        def run_inner(group: Any, route: str) -> None:
            rows = [torch.empty_like(tensor) for _ in range(self._size)]
            inner_allgather(group, rows, tensor)
            keep(rows)

        def keep(rows: list[torch.Tensor]) -> None:
            if self._rank == root:
                for out, row in zip(outputs, rows, strict=True):
                    with torch.no_grad():
                        out.copy_(row)

        inner = self._inner([tensor, *outputs], run_inner)
        return self._submit(call, run, output_lists, inner=inner)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        self._check("scatter", outputs)
        call = Call.of("scatter", outputs, f"root {root}")
        output = outputs[0]
        inputs = input_lists[0] if input_lists else []

        def parts() -> torch.Tensor:
            if self._rank == root:
                return torch.cat([t.reshape(-1) for t in inputs])
            return output.new_empty(output.numel() * self._size)

        def keep(parts: torch.Tensor) -> None:
            mine = parts[self._rank * output.numel() : (self._rank + 1) * output.numel()]
            with torch.no_grad():
                output.copy_(mine.view(output.shape))

        async def run(group: Transport) -> None:
            flat = parts().cpu()
            await broadcast_op(group, [flat], root)
            keep(flat)

        def run_inner(group: Any, route: str) -> None:
            flat = parts()
            inner_broadcast(group, [flat], root)
            keep(flat)

        inner = self._inner([*outputs, *inputs], run_inner)
        return self._submit(call, run, outputs, inner=inner)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        # torch's layout (as gloo's): output_lists[r][i] receives rank r's inputs[i].
        if len(output_lists) != self._size:
            raise ValueError(
                f"all_gather_coalesced: {len(output_lists)} output lists for a group of "
                f"{self._size} (one per rank)"
            )
        for rank, outputs in enumerate(output_lists):
            if len(outputs) != len(inputs):
                raise ValueError(
                    f"all_gather_coalesced: output list {rank} has {len(outputs)} tensors "
                    f"for {len(inputs)} inputs"
                )
        per_input = [[outputs[i] for outputs in output_lists] for i in range(len(inputs))]
        for outputs, tensor in zip(per_input, inputs, strict=True):
            self._check_gather("all_gather_coalesced", outputs, tensor)
        call = Call.of("allgather_coalesced", inputs)

        async def run(group: Transport) -> None:
            for outputs, tensor in zip(per_input, inputs, strict=True):
                await allgather_op(group, outputs, tensor)

        def run_inner(group: Any, route: str) -> None:
            for outputs, tensor in zip(per_input, inputs, strict=True):
                inner_allgather(group, outputs, tensor)

        inner = self._inner([*inputs, *(o for outs in per_input for o in outs)], run_inner)
        return self._submit(call, run, output_lists, inner=inner)

    # torch 2.13's names for the tensor forms (older torch calls the names above).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Finish this rank's part of the group (``destroy_process_group`` calls it)."""
        self.parallel_watch.forget()
        self.session.close()
        if self.session.inner is not None:
            self.session.inner.shutdown()

    def abort(self) -> None:
        self.parallel_watch.forget()
        self.session.close()
        if self.session.inner is not None:
            self.session.inner.abort()


async def _allreduce(tensors: list[torch.Tensor], op: str, group: Transport) -> None:
    await allreduce_op(group, tensors, op)


async def _broadcast(tensors: list[torch.Tensor], root: int, group: Transport) -> None:
    await broadcast_op(group, tensors, root)


async def _allgather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: Transport) -> None:
    await allgather_op(group, outputs, tensor)


async def _allgather_flat(
    output: torch.Tensor, rows: list[torch.Tensor], tensor: torch.Tensor, group: Transport
) -> None:
    if not rows:
        return
    await allgather_op(group, rows, tensor)


async def _reduce_scatter(
    output: torch.Tensor, inputs: list[torch.Tensor], op: str, group: Transport
) -> None:
    if not inputs:
        return
    await reduce_scatter_op(group, output, inputs, op)


async def _alltoall(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: Transport,
) -> None:
    await alltoall_op(group, output, tensor, output_splits, input_splits)


__all__ += ["BackendError"]

install_monitored_barrier(lambda group: isinstance(group, ProcessGroupParamsync))
