"""A pipeline rank executing its schedule: `PipelineStage`.

One `PipelineStage` per pipeline rank holds that rank's v model chunks (stages r, r + p, ...;
`paramsync.actors.parallel.stages`) and, per training step, executes the rank's list of actions
(`paramsync.runtime.parallel.actions`, as a schedule generator gives them) in order over the
pipeline `ProcessGroup`:

- FORWARD runs a chunk on one micro-batch: stage 0 takes micro-batch i of the inputs, another
  stage the activation received (or handed over by the previous stage when it lives on this
  rank too); the last stage computes ``loss_fn(output, target_i)`` and keeps ``loss / m`` for
  the backward, so the step's gradient is the mean over the micro-batches.
- BACKWARD runs autograd from the received output gradient (the last stage: from ``loss / m``)
  to the stage's input and weights at once; BACKWARD_INPUT (zero-bubble) computes the input
  gradient only, keeping the gradients that flowed into every node where a weight's subgraph
  meets the activation-gradient chain, and BACKWARD_WEIGHT the weight gradients later from
  those alone, without walking the chain again (`paramsync.actors.parallel.split_backward`, as
  torch's ``stage_backward_input`` / ``stage_backward_weight``): I + W cost about one B.
- SEND_ACTIVATION / SEND_GRADIENT hand the tensor over (to the peer's sender thread, or to
  the trio side, which starts a tagged `isend` in the step's nursery: below); the list goes on
  at once. A send leaves as soon as its tensor is computed and every send before it in the
  list has left, which may be before the walk reaches it (the peer gets the same messages in
  the same order, only earlier; the compute order is the list's). RECV_ACTIVATION /
  RECV_GRADIENT wait for a receive posted ahead: when the step starts, every receive of the
  list is posted with the declared activation shape and dtype, and one receiver per peer (a
  thread, or a trio task) takes that peer's messages in list order, as early as they come (as
  torch posts its irecvs ahead), each into a buffer allocated just before (so a step holds
  buffers only for the messages that came, bounded by how far the peer's schedule runs ahead,
  not all m from the start); p2p refuses another tag or dtype, naming the peer,
  and another shape (through trio) or size (on lent links; the sender checks its output's
  shape against the declared one). The tag is ``action.tag(step)``: step, the sending stage,
  the micro-batch and the direction, the same at both ends. A receive takes the next message
  its peer sent, so a rank must receive from each peer in the order that peer sends to it:
  every list that runs on rendezvous channels does
  (`paramsync.runtime.parallel.schedules.build_schedule`'s are simulated so); with a list that does
  not, the receive meets a message of another tag: a ProtocolError naming both tags, never a swap.
- The list itself is walked on one compute thread per step (one `trio.to_thread.run_sync` for
  the whole list, not one per action): compute runs there back to back, a receive is a wait on
  a thread event (``recv_seconds`` counts from when the walk reaches it), a send a hand-over.
  Who moves the bytes: when the pp group can lend its connections to threads
  (`paramsync.runtime.transport.capabilities.BlockingLinkProvider`, plaintext TCP; ``thread_links``,
  on by default), the step borrows them (`blocking_links`) and runs one sender thread and one
  receive thread per peer over them (`paramsync.runtime.collectives.p2p.send_on_links` /
  `recv_on_links`, the same frames): a send is a queue put, each thread blocks in the system calls
  with the GIL released, and trio is not woken per message (handing each send to trio cost the
  compute thread 0.3-0.6 ms of GIL wait, and the peer's drain; a step of interleaved 1F1B on the
  benchmark spent 10-12 ms so, now under 1 ms). Otherwise (in-process worlds, TLS, torch's plane,
  ``thread_links=False``) a send is a `TrioToken.run_sync_soon` starting an `isend`, and the
  receives are trio tasks; several ranks of an in-process world share one trio loop. A failed
  receive or send, or a cancelled step, wakes the walk, which stops at its next wait or between two
  actions (an action's compute is never interrupted half-way); on lent links the step shuts them
  down to wake their threads (the transport is then broken, as after any failed collective, and the
  stage closes its groups anyway). A receive thread on lent links also fails on a peer silent for
  the transport's ``stall_seconds`` (300 s on TCP), even without ``recv_seconds``.
  `PipelineStage.on_action` is called on the compute thread after each action (the tracer's hook,
  `paramsync.actors.parallel.traced_stage`).
- Weight gradients fold into ``param.grad`` in ascending micro-batch order
  (`paramsync.actors.parallel.microbatch_grads`): every schedule gives bitwise the same gradients.

`train_step` adds what follows a pipeline step: the dp average and the tied-embedding sum
(`paramsync.actors.parallel.pipeline_grads`), the optimizer step, and the step's mean loss,
broadcast from the last stage to every rank of the pipeline group (each dp replica gets the mean
over its own micro-batches).

A failed step (a compute error, a peer gone, a receive waiting longer than ``recv_seconds``)
closes every group the stage uses, so that its peers' sends and receives fail too instead of
waiting for it (as a crashed process's connections close), and raises; the stage is then
broken and refuses further steps.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import trio
from torch import nn

from paramsync.actors.parallel.microbatch_grads import OrderedGradients
from paramsync.actors.parallel.pipeline_grads import (
    average_over_dp,
    broadcast_tied,
    sum_tied,
)
from paramsync.actors.parallel.split_backward import WeightGradients, backward_input
from paramsync.actors.parallel.stages import (
    StageChunk,
    check_stage_layout,
    split_blocks,
    stage_rank,
)
from paramsync.runtime.collectives.p2p import isend, recv, recv_on_links, send_on_links
from paramsync.runtime.collectives.ring import broadcast
from paramsync.runtime.errors import StallError, first_error
from paramsync.runtime.parallel.actions import Action, ActionKind
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.capabilities import BlockingLinkProvider, BlockingLinkSet

__all__ = ["PipelineStage", "PipelineStepResult", "ActivationShape", "split_microbatches"]

ActivationShape = tuple[int, ...] | Callable[[int, int], Sequence[int]]
"""The shape of what stage s sends for micro-batch i (its output, one tensor, and the gradient
coming back): one shape for every boundary, or ``shape(stage, microbatch)`` (shapes may vary by
stage and micro-batch; nothing is inferred once and reused). Receivers post buffers of this
shape, as Megatron's ``tensor_shape``; a stage whose output has another shape or dtype is an
error naming the stage and micro-batch."""


def split_microbatches(batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """``batch`` cut along dim 0 into ``microbatches`` equal micro-batches (an error if the
    batch does not divide)."""
    if microbatches < 1 or batch.shape[0] % microbatches:
        raise ValueError(
            f"a batch of {batch.shape[0]} does not split into {microbatches} equal micro-batches"
        )
    return list(batch.chunk(microbatches))


@dataclass
class PipelineStepResult:
    """What one executed list leaves: the last stage's per-micro-batch losses (unscaled), in
    micro-batch order; empty on a rank without the last stage."""

    step: int
    losses: list[float] = field(default_factory=list)

    @property
    def loss(self) -> float | None:
        """The mean loss over the micro-batches (None on a rank without the last stage)."""
        return math.fsum(self.losses) / len(self.losses) if self.losses else None


@dataclass
class _Forward:
    """One micro-batch's forward on one stage, kept for its backward."""

    input: torch.Tensor  # the stage input (a leaf requiring grad, except for stage 0)
    output: torch.Tensor | None  # the chunk's output with its graph, or loss / m on the last
    # stage; None once a BACKWARD_INPUT has left what the weight pass needs in ``weights``
    input_grad_done: bool = False
    weights: WeightGradients | None = None


class PipelineStage:
    """Pipeline rank ``pp_group.rank``'s chunks, executing its action list each step.

    ``chunks``: stage -> module for every stage this rank holds (stage s lives on rank s % p;
    build them with `from_blocks`). ``num_stages``: p * v. ``loss_fn(output, target)`` on the
    last stage. ``activation_shape``/``activation_dtype``: what travels between stages.
    ``dp_group``: this stage's data-parallel group (gradients averaged over it in
    `train_step`). ``tied``: pairs of parameter names ("<block>.<name>", first stage's then
    last stage's) that are one weight in the model; ``embedding_group`` is the 2-rank group of
    the first and the last pipeline rank
    (`paramsync.actors.parallel.pipeline_grads.new_embedding_group`). ``recv_seconds``: how long one
    receive may wait before the step fails (None: no limit). ``thread_links``: when ``pp_group`` can
    lend its connections to threads
    (`paramsync.runtime.transport.capabilities.BlockingLinkProvider`: plaintext TCP), move the
    step's messages on threads over them (sends from the compute thread itself, receives on one
    thread per peer), so that no message wakes the trio loop; False, or a group that cannot lend
    them (in-process, TLS, torch's plane), moves them through trio.
    """

    def __init__(
        self,
        chunks: dict[int, nn.Module],
        *,
        pp_group: Transport,
        num_stages: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        activation_shape: ActivationShape,
        activation_dtype: torch.dtype = torch.float32,
        dp_group: Transport | None = None,
        embedding_group: Transport | None = None,
        tied: Sequence[tuple[str, str]] = (),
        recv_seconds: float | None = None,
        thread_links: bool = True,
    ) -> None:
        self.pp_group = pp_group
        self.thread_links = thread_links
        self.pp_size = pp_group.world_size
        self.rank = pp_group.rank
        if num_stages % self.pp_size:
            raise ValueError(
                f"{num_stages} stages do not spread evenly over {self.pp_size} pipeline ranks"
            )
        self.num_stages = num_stages
        self.chunks_per_rank = num_stages // self.pp_size
        check_stage_layout(self.pp_size, self.chunks_per_rank)
        expected = [s for s in range(num_stages) if stage_rank(s, self.pp_size) == self.rank]
        if sorted(chunks) != expected:
            raise ValueError(
                f"pipeline rank {self.rank} of {self.pp_size} holds stages {expected} of "
                f"{num_stages}, got chunks for stages {sorted(chunks)}"
            )
        self.chunks = dict(sorted(chunks.items()))
        self.loss_fn = loss_fn
        self.activation_shape = activation_shape
        self.activation_dtype = activation_dtype
        self.dp_group = dp_group
        self.embedding_group = embedding_group
        self.recv_seconds = recv_seconds
        self.tied_params = self._find_tied(tied)
        self._grads = {
            stage: OrderedGradients(stage, [p for p in chunk.parameters() if p.requires_grad])
            for stage, chunk in self.chunks.items()
        }
        self.step_count = 0
        self.broken: BaseException | None = None

    @classmethod
    def from_blocks(
        cls,
        blocks: nn.Sequential | Sequence[nn.Module],
        *,
        pp_group: Transport,
        chunks_per_rank: int = 1,
        **options: Any,
    ) -> PipelineStage:
        """Split ``blocks`` into p * v chunks (`split_blocks`) and keep this rank's."""
        num_stages = check_stage_layout(pp_group.world_size, chunks_per_rank)
        chunks = split_blocks(blocks, num_stages)
        mine: dict[int, nn.Module] = {
            chunk.stage: chunk
            for chunk in chunks
            if stage_rank(chunk.stage, pp_group.world_size) == pp_group.rank
        }
        return cls(mine, pp_group=pp_group, num_stages=num_stages, **options)

    # ------------------------------------------------------------------ parameters

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once, stage by stage (what its optimizer steps)."""
        seen: set[int] = set()
        params = []
        for chunk in self.chunks.values():
            for p in chunk.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def _find_tied(self, tied: Sequence[tuple[str, str]]) -> list[nn.Parameter]:
        """This rank's copies of the tied weights (first stage's name, else last stage's)."""
        first, last = 0, self.num_stages - 1
        found: list[nn.Parameter] = []
        for pair in tied:
            if len(pair) != 2:
                raise ValueError(f"a tied pair names two parameters, got {pair!r}")
            head = self._chunk_parameter(first, pair[0])
            tail = self._chunk_parameter(last, pair[1])
            if self.pp_size == 1:
                if head is not None and tail is not None and head is not tail:
                    raise ValueError(
                        f"tied parameters {pair[0]!r} and {pair[1]!r} are two tensors on one "
                        "pipeline rank: tie them in the model (one nn.Parameter)"
                    )
                continue
            copy = head if head is not None else tail
            if (first in self.chunks or last in self.chunks) and copy is None:
                raise ValueError(
                    f"tied pair {pair!r}: stage {first} holds no {pair[0]!r} or stage {last} "
                    f"no {pair[1]!r}"
                )
            if copy is not None:
                found.append(copy)
        if found and self.embedding_group is None:
            raise ValueError(
                f"pipeline rank {self.rank} holds tied weights but no embedding group "
                "(new_embedding_group)"
            )
        return found

    def _chunk_parameter(self, stage: int, name: str) -> nn.Parameter | None:
        chunk = self.chunks.get(stage)
        if chunk is None:
            return None
        if not isinstance(chunk, StageChunk):
            raise ValueError(
                f"stage {stage}'s chunk is a {type(chunk).__name__}: tied weights need chunks "
                "made by split_blocks (PipelineStage.from_blocks)"
            )
        param = chunk.block_parameter(name)
        if param is None:
            raise ValueError(f"stage {stage} holds no parameter {name!r}")
        return param

    # ------------------------------------------------------------------ one step

    def _shape(self, stage: int, microbatch: int) -> tuple[int, ...]:
        shape = self.activation_shape
        if callable(shape):
            return tuple(int(d) for d in shape(stage, microbatch))
        return tuple(shape)

    async def run_schedule(
        self,
        actions: Sequence[Action],
        inputs: Sequence[torch.Tensor] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
        *,
        microbatches: int | None = None,
        step: int | None = None,
    ) -> PipelineStepResult:
        """Execute this rank's ``actions`` for one step; gradients accumulate into ``.grad``.

        ``inputs``: the m micro-batches of stage 0 (on the rank holding it), ``targets``: the
        m targets of the last stage (on its rank); ``microbatches`` says m on the other ranks
        (default: from inputs or targets, else from the actions). ``step`` (default: the
        stage's own count) goes into every tag. Raises on any failure, after closing the
        stage's groups (see the module's docstring).
        """
        if self.broken is not None:
            raise RuntimeError(
                f"pipeline rank {self.rank}: a previous step failed ({self.broken!r}); the "
                "stage's groups are closed"
            )
        step = self.step_count if step is None else step
        try:
            result = await _StepRun(self, list(actions), inputs, targets, microbatches, step).run()
        except BaseException as exc:
            await self.fail(exc)
            raise
        self.step_count = step + 1
        return result

    async def finalize_grads(self) -> None:
        """The dp average of every gradient, then the tied weights' sum over the embedding
        group (`paramsync.actors.parallel.pipeline_grads`)."""
        try:
            trained = [p for p in self.parameters() if p.requires_grad]
            await average_over_dp(self.dp_group, trained)
            await sum_tied(self.embedding_group, self.tied_params)
        except BaseException as exc:
            await self.fail(exc)
            raise

    async def sync_tied_weights(self) -> None:
        """Copy the first stage's tied weights to the last stage's (once, before training)."""
        await broadcast_tied(self.embedding_group, self.tied_params)

    async def train_step(
        self,
        actions: Sequence[Action],
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        optimizer: torch.optim.Optimizer,
        *,
        microbatches: int | None = None,
        broadcast_loss: bool = True,
    ) -> float | None:
        """One training step: zero the gradients, run the list, finalize the gradients (dp
        average, tied sum), step ``optimizer``; return the mean loss over this replica's
        micro-batches: on every pipeline rank with ``broadcast_loss`` (one small broadcast
        from the last stage's rank), else only on the last stage's (None elsewhere)."""
        optimizer.zero_grad(set_to_none=True)
        result = await self.run_schedule(actions, inputs, targets, microbatches=microbatches)
        await self.finalize_grads()
        optimizer.step()
        if not broadcast_loss or self.pp_size == 1:
            return result.loss
        value = torch.tensor([result.loss if result.loss is not None else 0.0], dtype=torch.float64)
        last_rank = stage_rank(self.num_stages - 1, self.pp_size)
        try:
            await broadcast(self.pp_group, value, root=last_rank)
        except BaseException as exc:
            await self.fail(exc)
            raise
        return float(value[0])

    def on_action(self, step: int, action: Action, started_ns: int, ended_ns: int) -> None:
        """Called on the stage's compute thread after each action of a step's list with its
        `time.perf_counter_ns` start and end (a receive: the wait for it; a send: its hand-off
        to its sender thread or the trio side). Does nothing here;
        `paramsync.actors.parallel.traced_stage` records spans. It runs between two actions, so it
        should be quick; an error it raises fails the step."""

    async def fail(self, exc: BaseException) -> None:
        """Mark the stage broken by ``exc`` and close every group it uses (shielded), so its
        peers' sends and receives fail instead of waiting for it; later steps are refused."""
        if self.broken is None:
            self.broken = exc
        with trio.CancelScope(shield=True):
            for group in (self.pp_group, self.dp_group, self.embedding_group):
                if group is not None:
                    await group.aclose()


class _Posted:
    """A receive posted ahead of the walk: its action, the shape and dtype its message must
    have, its buffer once the receiver takes it up, and whether it arrived.

    The buffer is allocated by the receiver just before it receives into it (`allocate`), not
    when the step posts the receive: a step's buffers then hold only the messages that have
    come or are coming next from each peer (bounded by how far the peer's schedule lets it run
    ahead), not all m of them from the step's start."""

    __slots__ = ("action", "arrived", "buffer", "dtype", "shape")

    def __init__(self, action: Action, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.action = action
        self.shape = shape
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self.arrived = threading.Event()

    def allocate(self) -> torch.Tensor:
        """The buffer to receive into (allocated on the first call)."""
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=self.dtype)
        return self.buffer


class _Aborted(Exception):
    """The walk was woken because the step is being cancelled (never leaves `_StepRun`)."""


class _StepRun:
    """One step's execution of one rank's list (state lives here, not on the stage)."""

    def __init__(
        self,
        stage: PipelineStage,
        actions: list[Action],
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        microbatches: int | None,
        step: int,
    ) -> None:
        self.stage = stage
        self.actions = actions
        self.step = step
        self.m = self._count(inputs, targets, microbatches)
        self.inputs = inputs
        self.targets = targets
        first, last = 0, stage.num_stages - 1
        if first in stage.chunks and (inputs is None or len(inputs) != self.m):
            raise ValueError(
                f"pipeline rank {stage.rank} holds stage 0: it needs the {self.m} input "
                "micro-batches"
            )
        if last in stage.chunks and (targets is None or len(targets) != self.m):
            raise ValueError(
                f"pipeline rank {stage.rank} holds the last stage ({last}): it needs the "
                f"{self.m} target micro-batches"
            )
        self.received: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> its input
        self.grad_in: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output's grad
        self.to_send: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
        self.forwards: dict[tuple[int, int], _Forward] = {}
        self.losses: dict[int, float] = {}
        self._posted: dict[int, _Posted] = {}  # list index of a receive -> its posted buffer
        self._sends: list[int] = []  # list indices of the sends (filled once the list is checked)
        self._sent = 0  # how many of them have left
        self._aborted = False
        self._finished = False  # the walk reached the list's end
        self._send_error: BaseException | None = None
        self._links: BlockingLinkSet | None = None  # the pp group's connections, lent
        # per peer, the sends handed to its sender thread (None: no more) over lent links
        self._outboxes: dict[int, queue.SimpleQueue[tuple[Action, torch.Tensor] | None]] = {}
        self._senders_left = 0
        self._sends_done = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None

    def _count(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        microbatches: int | None,
    ) -> int:
        for given in (microbatches, None if inputs is None else len(inputs)):
            if given is not None:
                return given
        if targets is not None:
            return len(targets)
        return 1 + max((a.microbatch for a in self.actions), default=-1)

    def where(self, action: Action) -> str:
        return f"pipeline rank {self.stage.rank}, step {self.step}, action {action}"

    async def run(self) -> PipelineStepResult:
        for grads in self.stage._grads.values():
            grads.start(self.m)
        self._check_actions()
        self._sends = [i for i, action in enumerate(self.actions) if action.kind.is_send]
        inboxes = self._post_receives()
        self._token = trio.lowlevel.current_trio_token()
        peers = {action.peer for action in self.actions if action.peer is not None}
        with first_error():
            async with self._lend_links(peers) as links:
                self._links = links
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    watch = trio.CancelScope()
                    nursery.start_soon(self._abort_when_cancelled, watch)
                    for peer, posted in inboxes.items():
                        receive = (
                            self._receive_in_order if links is None else self._receive_threaded
                        )
                        nursery.start_soon(receive, peer, posted)
                    if links is not None:
                        self._start_senders(nursery)
                    else:
                        self._sends_done.set()  # trio's isends: the nursery waits for them
                    await trio.to_thread.run_sync(self._walk)
                    await self._sends_done.wait()
                    self._finished = True
                    watch.cancel()
        self._check_complete()
        return PipelineStepResult(self.step, [self.losses[i] for i in range(len(self.losses))])

    # ------------------------------------------------------------------ the trio side

    def _post_receives(self) -> dict[int, list[_Posted]]:
        """Every receive of the list with its declared shape and dtype (its buffer allocated
        when the receiver takes it up), grouped by peer in list order (a peer's messages come in
        the order it sends them, which the list follows)."""
        inboxes: dict[int, list[_Posted]] = {}
        for index, action in enumerate(self.actions):
            if not action.kind.is_recv:
                continue
            assert action.peer is not None
            boundary = (
                action.stage if action.kind is ActionKind.RECV_ACTIVATION else action.stage - 1
            )
            shape = self.stage._shape(boundary, action.microbatch)
            posted = _Posted(action, shape, self.stage.activation_dtype)
            self._posted[index] = posted
            inboxes.setdefault(action.peer, []).append(posted)
        return inboxes

    @asynccontextmanager
    async def _lend_links(self, peers: set[int]) -> AsyncIterator[BlockingLinkSet | None]:
        """The pp group's connections to ``peers`` lent to this step's threads, when the stage
        may use them and the group can lend them (else None: messages go through trio).
        Leaving by an error breaks them (`BlockingLinkProvider.blocking_links`)."""
        group = self.stage.pp_group
        if (
            self.stage.thread_links
            and peers
            and isinstance(group, BlockingLinkProvider)
            and group.supports_blocking
        ):
            async with group.blocking_links(peers) as links:
                yield links
        else:
            yield None

    def _start_senders(self, nursery: trio.Nursery) -> None:
        """One sender thread per peer this list sends to, fed by the walk in list order."""
        peers = sorted({peer for i in self._sends if (peer := self.actions[i].peer) is not None})
        self._outboxes = {peer: queue.SimpleQueue() for peer in peers}
        self._senders_left = len(peers)
        if not peers:
            self._sends_done.set()
        for peer in peers:
            nursery.start_soon(self._send_threaded, peer)

    async def _send_threaded(self, peer: int) -> None:
        await trio.to_thread.run_sync(self._send_on_links, peer)
        self._senders_left -= 1
        if self._senders_left == 0:
            self._sends_done.set()

    def _send_on_links(self, peer: int) -> None:
        """On ``peer``'s sender thread: each send the walk hands over, in order, over the lent
        links (blocking, GIL released, while the peer drains it), until the walk's end (None)
        or the step's abort. The compute thread never waits for a peer to read."""
        links, group, outbox = self._links, self.stage.pp_group, self._outboxes[peer]
        assert links is not None
        while (item := outbox.get()) is not None:
            if self._aborted:
                return
            action, tensor = item
            try:
                send_on_links(links, group, tensor, peer, action.tag(self.step))
            except Exception as exc:
                if self._aborted:
                    return
                exc.add_note(f"while executing {self.where(action)}")
                raise

    async def _receive_threaded(self, peer: int, posted: list[_Posted]) -> None:
        """Receive ``peer``'s messages on a thread of their own, over the lent links."""
        await trio.to_thread.run_sync(self._receive_on_links, peer, posted)

    def _receive_on_links(self, peer: int, posted: list[_Posted]) -> None:
        """On a receive thread: ``peer``'s messages in list order, each into its posted buffer
        as soon as it comes (blocking with the GIL released meanwhile). Once the step is
        aborted (the links are shut down to wake it), it stops quietly: the step's nursery
        holds the cause."""
        links, group = self._links, self.stage.pp_group
        assert links is not None
        for entry in posted:
            if self._aborted:
                return
            try:
                recv_on_links(links, group, entry.allocate(), peer, entry.action.tag(self.step))
            except Exception as exc:
                if self._aborted:
                    return
                exc.add_note(f"while receiving for {self.where(entry.action)}")
                raise
            entry.arrived.set()

    async def _receive_in_order(self, peer: int, posted: list[_Posted]) -> None:
        """Receive ``peer``'s messages ahead of the walk, each into its posted buffer."""
        group = self.stage.pp_group
        for entry in posted:
            await recv(group, entry.allocate(), peer, entry.action.tag(self.step))
            entry.arrived.set()

    async def _abort_when_cancelled(self, watch: trio.CancelScope) -> None:
        """Wake the walk when the step is cancelled (a receive or send failed, or a caller's
        deadline): the thread stops at its next wait or between two actions. Cancelled by
        `run` itself once the walk is done."""
        with watch:
            try:
                await trio.sleep_forever()
            finally:
                if not self._finished:
                    self._abort()

    def _abort(self) -> None:
        """Wake every thread of the step: the walk at its next wait or between two actions,
        a thread blocked on a lent link by shutting the links down (which breaks them)."""
        self._aborted = True
        if self._links is not None:
            self._links.abort()
        for outbox in self._outboxes.values():
            outbox.put(None)
        for entry in self._posted.values():
            entry.arrived.set()

    def _start_send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """On the trio thread (`TrioToken.run_sync_soon`, in the order the walk handed the
        sends over): start the send in the step's nursery. Never raises into trio's loop."""
        assert self._nursery is not None
        try:
            isend(self._nursery, self.stage.pp_group, tensor, peer, tag)
        except BaseException as exc:  # the nursery is closing: the step failed already
            self._send_error = exc
            self._abort()

    # ------------------------------------------------------------------ the compute thread

    def _walk(self) -> None:
        """The list, action by action, on this step's compute thread. A send leaves as soon as
        its tensor is computed and every send before it in the list has left (`_send_ready`),
        which may be before the walk reaches it: the peer receives the same messages in the
        same order, only earlier (a list written for rendezvous channels often places a send
        after the next compute, and the peer would wait for that compute)."""
        hook = self.stage.on_action
        clock = time.perf_counter_ns
        for index, action in enumerate(self.actions):
            if self._aborted:
                break  # the nursery reports why (or a send that could not start, below)
            if action.kind.is_send:
                if index >= self._next_send_at():
                    raise RuntimeError(
                        f"{self.where(action)}: nothing computed to send yet"
                    )  # every send before it has left: its own tensor is missing
                continue  # left already, its hook called then
            started = clock()
            try:
                self._execute(index, action)
            except _Aborted:
                break
            except Exception as exc:
                exc.add_note(f"while executing {self.where(action)}")
                raise
            hook(self.step, action, started, clock())
            self._send_ready()
        if self._send_error is not None:
            raise self._send_error
        for outbox in self._outboxes.values():
            outbox.put(None)  # every send handed over: the sender threads finish them

    def _next_send_at(self) -> int:
        """The list index of the first send that has not left (the list's length if none)."""
        sends = self._sends
        return sends[self._sent] if self._sent < len(sends) else len(self.actions)

    def _send_ready(self) -> None:
        """Hand every send whose tensor is computed over, in list order, stopping at the first
        whose tensor is not (sends to a peer leave in list order): to the peer's sender thread
        over the lent links, else to the trio side."""
        hook = self.stage.on_action
        links = self._links
        while self._sent < len(self._sends):
            action = self.actions[self._sends[self._sent]]
            tensor = self.to_send.pop((action.kind, action.stage, action.microbatch), None)
            if tensor is None:
                return
            assert action.peer is not None and self._token is not None
            started = time.perf_counter_ns()
            if links is not None:
                self._outboxes[action.peer].put((action, tensor))
            else:
                self._token.run_sync_soon(
                    self._start_send, tensor, action.peer, action.tag(self.step)
                )
            self._sent += 1
            hook(self.step, action, started, time.perf_counter_ns())

    # ------------------------------------------------------------------ checks

    def _check_actions(self) -> None:
        stage = self.stage
        for action in self.actions:
            if not isinstance(action, Action):
                raise TypeError(f"pipeline rank {stage.rank}: {action!r} is not an Action")
            own = action.stage
            if action.kind is ActionKind.RECV_ACTIVATION:
                own = action.stage + 1
            elif action.kind is ActionKind.RECV_GRADIENT:
                own = action.stage - 1
            if own not in stage.chunks:
                raise ValueError(
                    f"{self.where(action)}: this rank holds stages {sorted(stage.chunks)}, "
                    f"not stage {own}"
                )
            if action.microbatch >= self.m:
                raise ValueError(f"{self.where(action)}: the step has {self.m} micro-batches")
            if action.peer is not None and not 0 <= action.peer < stage.pp_size:
                raise ValueError(f"{self.where(action)}: peer {action.peer} is not a pp rank")

    def _check_complete(self) -> None:
        where = f"pipeline rank {self.stage.rank}, step {self.step}"
        if self.forwards:
            raise RuntimeError(
                f"{where}: forwards never backed: {sorted(self.forwards)} (stage, micro-batch)"
            )
        unsent = sorted((kind.value, s, i) for kind, s, i in self.to_send)
        if unsent:
            raise RuntimeError(f"{where}: outputs computed but never sent: {unsent}")
        for stage_index, grads in self.stage._grads.items():
            missing = grads.missing()
            if missing:
                raise RuntimeError(
                    f"{where}: stage {stage_index}'s list ended without the weight gradients "
                    f"of micro-batches {missing}"
                )
        last = self.stage.num_stages - 1
        if last in self.stage.chunks and len(self.losses) != self.m:
            raise RuntimeError(
                f"{where}: the last stage computed {len(self.losses)} losses of {self.m}"
            )

    # ------------------------------------------------------------------ actions

    def _execute(self, index: int, action: Action) -> None:
        kind = action.kind
        if kind is ActionKind.FORWARD:
            self._forward(action.stage, action.microbatch)
        elif kind is ActionKind.BACKWARD:
            self._backward(action.stage, action.microbatch, inputs=True, weights=True)
        elif kind is ActionKind.BACKWARD_INPUT:
            self._backward(action.stage, action.microbatch, inputs=True, weights=False)
        elif kind is ActionKind.BACKWARD_WEIGHT:
            self._backward(action.stage, action.microbatch, inputs=False, weights=True)
        else:
            assert kind.is_recv, kind  # sends leave from `_send_ready`
            self._receive(self._posted[index])

    def _receive(self, entry: _Posted) -> None:
        """Wait (on the compute thread) for a receive posted ahead; ``recv_seconds`` counts
        from when the walk reaches it."""
        action = entry.action
        seconds = self.stage.recv_seconds
        if not entry.arrived.wait(seconds) and not self._aborted:
            assert action.peer is not None  # a receive names its sender
            raise StallError(
                f"{self.where(action)}: nothing came within {seconds} s",
                peer=self.stage.pp_group.describe_peer(action.peer),
            )
        if self._aborted:
            raise _Aborted
        buffer = entry.buffer
        assert buffer is not None  # arrived: the receiver allocated it before setting the event
        if action.kind is ActionKind.RECV_ACTIVATION:
            self.received[(action.stage + 1, action.microbatch)] = buffer
        else:
            self.grad_in[(action.stage - 1, action.microbatch)] = buffer

    def _stage_input(self, stage: int, microbatch: int) -> torch.Tensor:
        if stage == 0:
            assert self.inputs is not None
            return self.inputs[microbatch]
        received = self.received.pop((stage, microbatch), None)
        if received is None:
            local = self.to_send.pop((ActionKind.SEND_ACTIVATION, stage - 1, microbatch), None)
            if local is None or (stage - 1) not in self.stage.chunks:
                raise RuntimeError(
                    f"stage {stage}'s input for micro-batch {microbatch} was neither received "
                    f"nor computed here (a RECV_ACTIVATION missing before this FORWARD?)"
                )
            received = local
        if received.is_floating_point():
            received.requires_grad_(True)
        return received

    def _forward(self, stage: int, microbatch: int) -> None:
        key = (stage, microbatch)
        if key in self.forwards:
            raise RuntimeError(f"stage {stage} forwards micro-batch {microbatch} twice")
        chunk = self.stage.chunks[stage]
        x = self._stage_input(stage, microbatch)
        last = stage == self.stage.num_stages - 1
        target = self.targets[microbatch] if last and self.targets is not None else None
        m = self.m
        loss_fn = self.stage.loss_fn

        def compute() -> tuple[torch.Tensor, float | None]:
            with torch.enable_grad():
                out = chunk(x)
                if target is None:
                    return out, None
                loss = loss_fn(out, target)
                return loss / m, float(loss.detach())

        output, loss = compute()
        self.forwards[key] = _Forward(x, output)
        if last:
            assert loss is not None
            self.losses[microbatch] = loss
            return
        self._check_output(stage, microbatch, output)
        self.to_send[(ActionKind.SEND_ACTIVATION, stage, microbatch)] = output.detach().contiguous()

    def _check_output(self, stage: int, microbatch: int, output: torch.Tensor) -> None:
        expected = self.stage._shape(stage, microbatch)
        if tuple(output.shape) != expected or output.dtype != self.stage.activation_dtype:
            raise ValueError(
                f"stage {stage}'s output for micro-batch {microbatch} is {output.dtype} of shape "
                f"{list(output.shape)}; the pipeline declares {self.stage.activation_dtype} of "
                f"shape {list(expected)} (activation_shape / activation_dtype)"
            )

    def _output_grad(self, stage: int, microbatch: int) -> torch.Tensor | None:
        if stage == self.stage.num_stages - 1:
            return None  # the loss: autograd starts from 1
        grad = self.grad_in.get((stage, microbatch))
        if grad is None:
            local = self.to_send.get((ActionKind.SEND_GRADIENT, stage + 1, microbatch))
            if local is None or (stage + 1) not in self.stage.chunks:
                raise RuntimeError(
                    f"stage {stage}'s output gradient for micro-batch {microbatch} was neither "
                    "received nor computed here (a RECV_GRADIENT missing before this backward?)"
                )
            grad = local
        return grad

    def _backward(self, stage: int, microbatch: int, *, inputs: bool, weights: bool) -> None:
        key = (stage, microbatch)
        forward = self.forwards.get(key)
        if forward is None:
            raise RuntimeError(
                f"stage {stage} has no forward of micro-batch {microbatch} to back (a backward "
                "before its forward, or twice)"
            )
        if weights and not inputs and not forward.input_grad_done:
            raise RuntimeError(
                f"stage {stage}: BACKWARD_WEIGHT of micro-batch {microbatch} before its "
                "BACKWARD_INPUT"
            )
        if inputs and forward.input_grad_done:
            raise RuntimeError(
                f"stage {stage}: the input gradient of micro-batch {microbatch} twice"
            )
        if weights and not inputs:
            self._backward_weight(stage, microbatch, forward)
            return
        grad_out = self._output_grad(stage, microbatch)
        wants_input = stage > 0 and forward.input.requires_grad
        output = forward.output
        assert output is not None
        if not weights:
            params = self.stage._grads[stage].params
            stage_input = forward.input if wants_input else None

            def compute_input() -> tuple[torch.Tensor | None, WeightGradients]:
                return backward_input(output, grad_out, stage_input, params)

            input_grad, forward.weights = compute_input()
            forward.output = None
            forward.input_grad_done = True
            self._send_input_grad(stage, microbatch, forward, wants_input, input_grad)
            self._drop_output_grad(stage, microbatch)
            return
        params = self.stage._grads[stage].params

        def compute() -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
            targets = ([forward.input] if wants_input else []) + list(params)
            if not targets:
                return None, []
            grads = torch.autograd.grad(
                [output],
                targets,
                None if grad_out is None else [grad_out],
                allow_unused=True,
            )
            if wants_input:
                return grads[0], list(grads[1:])
            return None, list(grads)

        input_grad, weight_grads = compute()
        forward.input_grad_done = True
        self._send_input_grad(stage, microbatch, forward, wants_input, input_grad)
        self.stage._grads[stage].add(microbatch, weight_grads)
        del self.forwards[key]
        self._drop_output_grad(stage, microbatch)

    def _backward_weight(self, stage: int, microbatch: int, forward: _Forward) -> None:
        """BACKWARD_WEIGHT: the weight gradients from what the BACKWARD_INPUT kept."""
        weights = forward.weights
        assert weights is not None
        weight_grads = weights.compute()
        forward.weights = None
        self.stage._grads[stage].add(microbatch, weight_grads)
        del self.forwards[(stage, microbatch)]

    def _send_input_grad(
        self,
        stage: int,
        microbatch: int,
        forward: _Forward,
        wants_input: bool,
        input_grad: torch.Tensor | None,
    ) -> None:
        if not wants_input:
            return
        if input_grad is None:
            input_grad = torch.zeros_like(forward.input)
        self.to_send[(ActionKind.SEND_GRADIENT, stage, microbatch)] = input_grad.contiguous()

    def _drop_output_grad(self, stage: int, microbatch: int) -> None:
        """Forget the output gradient once the input gradient is computed (a BACKWARD_WEIGHT
        needs only what its BACKWARD_INPUT kept)."""
        self.grad_in.pop((stage, microbatch), None)
        self.to_send.pop((ActionKind.SEND_GRADIENT, stage + 1, microbatch), None)
