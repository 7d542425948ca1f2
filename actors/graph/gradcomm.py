"""The gradient-comm actor: each bucket's flat buffer, its negotiation and its all-reduce.

It owns each bucket's flat buffer (the gradients are views of it, so backward fills it in
place), reports a ready bucket (pre-averaged over accumulation steps) to the coordinator, and
all-reduces it when the coordinator says go, overlapping the rest of backward; buckets run in the
coordinator's order on every rank. From an epoch's second step on, buckets are reduced at once
in the agreed order, without the round trip (the response cache). Each bucket is averaged by its
reducer (`paramsync.runtime.collectives.compression`: exactly, or compressed by ``comm_hook``).

With ``find_unused_parameters``, once a step's buckets are reduced the ranks all-reduce which
parameters each used (a flag per parameter, summed): a parameter some rank used keeps the
averaged gradient (zeros from the ranks that did not use it), one that no rank used gets no
gradient for the step (``.grad`` None until the optimizer has stepped, as torch DDP leaves a
globally unused parameter's gradient untouched), identically on every rank.

Buckets whose gradients live on a device (the `paramsync.runtime.transport.device_ops.DeviceOps`
the actor is given says which) keep their flat buffer on that device; `DeviceStaging`
(`paramsync.actors.graph.device_staging`) orders their reads after backward by events and
stages them through pinned host buffers where the transport cannot reduce them on the device,
with no device synchronize.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient, Go
from paramsync.actors.graph.device_staging import DeviceStaging
from paramsync.actors.graph.messages import BucketReady
from paramsync.actors.state.buckets import Bucket
from paramsync.runtime.actor.base import Actor, ActorStopped
from paramsync.runtime.collectives.compression import PowerSGDReducer, make_reducer, tag_spec
from paramsync.runtime.collectives.ring import ReduceOp, all_reduce
from paramsync.runtime.coordinator.events import agreement_hash, spec_hash
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.capabilities import NativeCollectives, SharedMemoryHolder
from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops

__all__ = ["CommOptions", "GradCommActor", "StepState"]


class CommOptions(Protocol):
    """What the gradient-comm actor reads of the trainer's options
    (`paramsync.actors.train.trainer.TrainerOptions` has them all)."""

    @property
    def accumulation_steps(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def threaded_min_bytes(self) -> int: ...
    @property
    def threaded_shared_memory(self) -> bool: ...
    @property
    def response_cache(self) -> bool: ...
    @property
    def find_unused_parameters(self) -> bool: ...
    @property
    def comm_hook(self) -> str: ...
    @property
    def powersgd_rank(self) -> int: ...
    @property
    def powersgd_start_iter(self) -> int: ...


@dataclass
class StepState:
    """One step's all-reduce progress: set ``all_reduced`` once every bucket is reduced, or
    with ``error`` when a bucket was lost."""

    step: int
    reduced: int = 0
    all_reduced: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    unused: frozenset[str] = frozenset()
    """Parameters this rank gave no gradient in the step (``find_unused_parameters``)."""
    unused_everywhere: tuple[str, ...] = ()
    """Parameters no rank gave a gradient in the step: their ``.grad`` is None until the
    optimizer has stepped (``find_unused_parameters``)."""


class GradCommActor(Actor):
    """Packs ready buckets, negotiates them with the coordinator, all-reduces them.

    The first step of an epoch negotiates every bucket: report it ready, all-reduce it when the
    coordinator says go, in the coordinator's order. Once every bucket has had its go, the
    members have agreed on each bucket's spec and order for the epoch (Horovod's response
    cache): from then on a bucket is reported ready marked cached and all-reduced at once, in
    the agreed order, without waiting for a round trip. The coordinator still checks each
    report against the agreement and stops the run naming the rank that differs, and the ring
    refuses a peer whose collective differs (ProtocolError), so nothing is reduced silently
    wrong. A new epoch (new members, a new ring) starts a new actor, hence a fresh negotiation.

    ``device_ops``: the device operations its device buckets use (default: the context's,
    `paramsync.runtime.transport.device_ops.context_device_ops`).
    """

    accepts = (BucketReady, Go)

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: list[Bucket],
        transport: Transport,
        client: CoordinatorClient,
        options: CommOptions,
        trace: TraceRecorder,
        epoch: int = 1,
        fold: bool = False,
        device_ops: DeviceOps | None = None,
    ) -> None:
        super().__init__("gradient-comm", mailbox_size=2 * len(buckets) + 4)
        self.buckets = buckets
        self.transport = transport
        self.client = client
        self.options = options
        self.trace = trace
        self.epoch = epoch
        if isinstance(transport, SharedMemoryHolder) and transport.shared_memory is not None:
            transport.shared_memory.threaded = options.threaded_shared_memory
        params = dict(model.named_parameters())
        self._params = [[params[name] for name in bucket.names] for bucket in buckets]
        ops = device_ops or context_device_ops()
        self.staging = DeviceStaging(ops, [_device_of(ops, ps) for ps in self._params])
        """The device buckets' events and host buffers."""
        self._flats = [
            torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
            for bucket, device in zip(buckets, self.staging.devices)
        ]
        """Per bucket: the flat buffer its gradients are views of (on their device)."""
        self._views = [_grad_views(ps, flat) for ps, flat in zip(self._params, self._flats)]
        for index in range(len(buckets)):
            self._bind(index)
        self._fold = fold
        """Every member folds: cached buckets get no report, the step report says so."""
        self._use_reducers(options)
        self._packed = [False] * len(buckets)
        """Per bucket: whether this step copied the gradients in (they were not views)."""
        self.current: StepState | None = None
        self._ready_ns: dict[int, int] = {}
        self._order: list[int] = []
        """Buckets in the order of the coordinator's gos (the epoch's first negotiation)."""
        self._cached: set[int] = set()
        """Buckets of the current step reported cached (reduced without a go)."""
        self._released: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        """(parameter, its bucket view) of the gradients set to None for the step: used by no
        rank (``find_unused_parameters``); bound again when the gradients are zeroed."""
        self._next = 0
        """Position in ``_order`` of the next cached bucket to reduce."""

    def _use_reducers(self, options: CommOptions) -> None:
        """Each bucket's reducer (how it is averaged: `paramsync.runtime.collectives.compression`,
        the comm hook of ``options``) and the specs the coordinator agrees on, tagged with it."""
        self._reducers = [
            make_reducer(
                options.comm_hook,
                bucket.index,
                bucket.shapes,
                bucket.dtype,
                powersgd_rank=options.powersgd_rank,
                powersgd_start_iter=options.powersgd_start_iter,
            )
            for bucket in self.buckets
        ]
        self._specs = [
            tag_spec(bucket.spec(), reducer.label)
            for bucket, reducer in zip(self.buckets, self._reducers)
        ]
        self._spec_hashes = [spec_hash(spec) for spec in self._specs]
        """What a cached report carries instead of the whole spec."""
        self._agreement = agreement_hash(dict(enumerate(self._spec_hashes)))
        for index, (flat, reducer) in enumerate(zip(self._flats, self._reducers)):
            if self.staging.on_device(index):
                # PowerSGD keeps its matrices on the host: its buckets are reduced there.
                native = (
                    isinstance(self.transport, NativeCollectives)
                    and self.transport.native_accepts(flat)
                    and not isinstance(reducer, PowerSGDReducer)
                )
                self.staging.place(index, flat, native)

    def use_comm_hook(self, options: CommOptions) -> None:
        """Average the buckets with ``options``' comm hook from now on (torch DDP's
        ``register_comm_hook``, before the epoch's first bucket is reported)."""
        if self._order or self._ready_ns or (self.current is not None and self.current.reduced):
            raise RuntimeError(
                "the comm hook can only change before the first backward: buckets were "
                "already reported with the old one"
            )
        self.options = options
        self._use_reducers(options)

    def _bind(self, index: int) -> None:
        """Make bucket ``index``'s gradients views of its flat buffer (torch DDP's
        ``gradient_as_bucket_view``): backward accumulates straight into the buffer and the
        reduced values land in the gradients, so neither needs a copy. A gradient that is not
        the view (none yet, or replaced: ``zero_grad(set_to_none=True)``) keeps its values."""
        views = self._views[index]
        if views is None:
            return
        with torch.no_grad():
            for param, view in zip(self._params[index], views):
                grad = param.grad
                if grad is view:
                    continue
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                param.grad = view

    def zero_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """What ``optimizer.zero_grad(set_to_none=False)`` does after a step, cheaper: a bucket
        whose gradients are still views of its flat buffer is zeroed in one fill, not one
        kernel per gradient; any other gradient the optimizer holds is zeroed on its own.
        Gradients released for a step no rank used them in are bound to their views again."""
        self._restore_released()
        done: set[int] = set()
        for index, flat in enumerate(self._flats):
            if self._bound(index):
                flat.zero_()
                done.update(id(param) for param in self._params[index])
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None and id(param) not in done:
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()

    def _restore_released(self) -> None:
        released, self._released = self._released, []
        for param, view in released:
            if param.grad is None and view is not None:
                param.grad = view

    def note_unused(self, step: int, names: frozenset[str]) -> None:
        """The parameters this rank gave no gradient in ``step`` (from the compute actor, before
        the step's last bucket is announced)."""
        state = self.current
        if state is not None and state.step == step:
            state.unused = names

    def _bound(self, index: int) -> bool:
        """Whether every gradient of bucket ``index`` is still its view of the flat buffer."""
        views = self._views[index]
        return views is not None and all(
            param.grad is view for param, view in zip(self._params[index], views)
        )

    @property
    def cache_ready(self) -> bool:
        """Whether buckets skip the round trip: every bucket has been agreed this epoch."""
        return self.options.response_cache and len(self._order) == len(self.buckets)

    def gradients_done(self, bucket: int) -> None:
        """Backward has enqueued the last gradient of ``bucket`` (called by the autograd hook,
        in backward's thread, before the bucket is announced): a device bucket records the
        event its reads wait on."""
        self.staging.gradients_done(bucket)

    def ready_soon(self, message: BucketReady) -> None:
        """Queue a bucket that backward finished (run by the event loop: must not raise). The
        mailbox holds every bucket and go of a step, so it is never full; if the actor is
        stopping, its epoch is ending and the step will be run again."""
        try:
            self.tell_nowait(message)
        except ActorStopped:
            pass
        except trio.WouldBlock:
            state = self.current
            if state is not None:
                state.error = RuntimeError(
                    f"step {message.step}: the gradient-comm mailbox is full (bucket "
                    f"{message.bucket} lost)"
                )
                state.all_reduced.set()

    def begin_step(self, step: int) -> StepState:
        """Expect ``len(buckets)`` reductions for ``step``."""
        self._restore_released()  # a step that was never applied: the gradients come back
        self.current = StepState(step)
        self.staging.clear()
        self._cached = set()
        self._next = 0
        if not self.buckets:
            self.current.all_reduced.set()
        return self.current

    async def handle(self, message: object) -> None:
        if isinstance(message, BucketReady):
            await self._ready(message)
        else:
            assert isinstance(message, Go)
            await self._reduce(message)

    async def _ready(self, message: BucketReady) -> None:
        bucket = self.buckets[message.bucket]
        flat = self._flats[message.bucket]
        fill: Callable[[], None] | None = None
        if self._bound(message.bucket):
            self._packed[message.bucket] = False  # backward wrote into the buffer itself
        else:
            for param in self._params[message.bucket]:
                if param.grad is None:  # unused by this rank (find_unused_parameters)
                    param.grad = torch.zeros_like(param)
            grads = [param.grad for param in self._params[message.bucket]]

            def pack() -> None:
                with self.trace.span("pack", actor="gradient-comm", bucket=bucket.index):
                    bucket.pack([g for g in grads if g is not None], flat)

            fill = pack
            self._packed[message.bucket] = True
        if self.staging.on_device(bucket.index):
            # C-STREAMSYNC-001: the bucket is read (packed, copied, reduced) only after the
            # event recorded once backward enqueued its last gradient.
            self.staging.send_out(bucket.index, flat, fill)
        elif fill is not None:
            fill()
        if self.options.accumulation_steps > 1 and not self.staging.staged(bucket.index):
            flat.div_(self.options.accumulation_steps)
        spec = self._specs[bucket.index]
        if self.cache_ready:  # a bucket's spec is fixed: the agreed one
            if self._fold:  # no message on the critical path: the step report carries it
                self.client.folded(message.step, self.epoch, self._agreement)
            else:
                await self.client.ready(
                    message.step,
                    bucket.index,
                    self._spec_hashes[bucket.index],
                    self.epoch,
                    cached=True,
                )
            self._cached.add(bucket.index)
            # Reduce in the agreed order: every rank runs the same collectives in sequence.
            while self._next < len(self._order) and self._order[self._next] in self._cached:
                index = self._order[self._next]
                self._next += 1
                await self.reduce_bucket(message.step, index)
            return
        # Step s+1 may report before step s is committed: the coordinator holds the report and
        # says go only after the commit, so the check stays off the critical path.
        await self.client.ready(message.step, bucket.index, spec, self.epoch)
        self._ready_ns[bucket.index] = time.perf_counter_ns()

    async def _reduce(self, go: Go) -> None:
        state = self.current
        if state is None or go.step != state.step:
            raise RuntimeError(f"coordinator said go for step {go.step} outside that step")
        if go.bucket in self._cached:
            return  # reduced from the cache already (a peer negotiated it: same spec)
        sent = self._ready_ns.pop(go.bucket, None)
        if sent is not None:
            self.trace.complete(
                "negotiate",
                sent,
                time.perf_counter_ns(),
                actor="gradient-comm",
                bucket=go.bucket,
                step=go.step,
            )
        if go.bucket not in self._order:
            self._order.append(go.bucket)
        await self.reduce_bucket(go.step, go.bucket)

    async def reduce_bucket(self, step: int, index: int) -> None:
        """All-reduce bucket ``index`` of ``step`` (its turn in the agreed order) and unpack
        it into the gradients. A hook point: a harness that must act in a step's all-reduce
        (the fault trials) wraps it in a subclass."""
        state = self.current
        assert state is not None and state.step == step
        bucket = self.buckets[index]
        flat = self._flats[index]
        reducer = self._reducers[index]
        staged = self.staging.staged(index)
        with self.trace.span(
            "all-reduce", actor="gradient-comm", bucket=index, bytes=reducer.payload_bytes()
        ):
            try:
                wire = await self.staging.host_buffer(index) if staged else flat
                if staged and self.options.accumulation_steps > 1:
                    wire.div_(self.options.accumulation_steps)
                await reducer.reduce(wire, self.transport.world_size, self._all_reduce_flat)
            except BaseException:
                # A failed all-reduce leaves unchecked bytes (and partial sums) in the bucket,
                # whose gradients are its views: poison it, never applied nor carried over.
                with torch.no_grad():
                    flat.zero_()
                raise
        if staged:
            self.staging.bring_back(index, flat)
        if self._packed[index]:
            grads = [param.grad for param in self._params[index]]
            bucket.unpack(flat, [g for g in grads if g is not None])
            self._bind(index)  # views again from the next step on
        state.reduced += 1
        if state.reduced == len(self.buckets):
            if self.options.find_unused_parameters:
                await self._agree_unused(state)
            state.all_reduced.set()

    async def _all_reduce_flat(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """One all-reduce over this epoch's transport with the trainer's settings (what a
        bucket's reducer calls, once or more per bucket)."""
        await all_reduce(
            self.transport,
            tensor,
            op,
            chunk_bytes=self.options.chunk_bytes,
            threaded_min_bytes=self.options.threaded_min_bytes,
        )

    async def _agree_unused(self, state: StepState) -> None:
        """All-reduce which parameters each rank used in the step; release the gradients of
        those no rank used (every rank runs this after its last bucket, in the same order)."""
        flags = torch.tensor(
            [0.0 if name in state.unused else 1.0 for b in self.buckets for name in b.names],
            dtype=torch.float32,
        )
        with self.trace.span("unused-params", actor="gradient-comm", step=state.step):
            await all_reduce(self.transport, flags, "sum", chunk_bytes=self.options.chunk_bytes)
        unused: list[str] = []
        position = 0
        for index, bucket in enumerate(self.buckets):
            views = self._views[index]
            for offset, (name, param) in enumerate(zip(bucket.names, self._params[index])):
                if flags[position] == 0:
                    unused.append(name)
                    self._released.append((param, views[offset] if views is not None else None))
                    param.grad = None
                position += 1
        state.unused_everywhere = tuple(unused)


def _device_of(ops: DeviceOps, params: Sequence[torch.Tensor]) -> torch.device | None:
    """The device a bucket's parameters live on, as ``ops`` sees them (None: the host, or
    several devices: its buffer is then on the host)."""
    devices = {param.device for param in params if ops.on_device(param)}
    if len(devices) != 1 or len(devices) != len({param.device for param in params}):
        return None
    return devices.pop()


def _grad_views(params: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor] | None:
    """One view of ``flat`` per parameter, shaped like it, in bucket order; None where the
    gradients cannot live in the buffer (a parameter on another device, another dtype)."""
    views = []
    offset = 0
    for param in params:
        if param.device != flat.device or param.dtype != flat.dtype:
            return None
        count = param.numel()
        views.append(flat[offset : offset + count].view(param.shape))
        offset += count
    return views
