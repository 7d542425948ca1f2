"""A `Trainer3D` under the coordinator: the layout agreed at the join, C-DDP-001 per shard.

`join_3d` joins a `CoordinatorClient` as a rank of a 3D-parallel run: its `ParallelLayout`
(`paramsync.runtime.parallel.run_layout.parallel_layout`: the ``("pp", "dp", "tp")`` mesh, the
rank's coordinates and the digest of the whole pipeline schedule) and the mesh, so the coordinator
refuses a run whose ranks disagree on any of it and knows the dp groups. Every rank declares the
dense model's signature (the coordinator holds one reference model; a rank's shard is a slice of
it).

`CoordinatorStepHooks` are the trainer's `StepHooks`: before each dp reduction the rank reports
its gradient bucket ready within its dp group and waits for the coordinator's go; after each
optimizer step it reports its shard digest and waits for the commit. The coordinator compares
digests within each (tp, pp) shard only and, on a mismatch, stops the run naming the shard and
the ranks (`paramsync.runtime.coordinator.layouts`, `paramsync.runtime.coordinator.commits`).
"""

from __future__ import annotations

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient, JoinResult
from paramsync.actors.parallel.shard_model import ModelSpec
from paramsync.actors.state.digest import StateDigest
from paramsync.runtime.collectives.groups import ProcessGroup
from paramsync.runtime.coordinator.events import bucket_spec, model_signature
from paramsync.runtime.parallel.config import ParallelismConfig
from paramsync.runtime.parallel.run_layout import parallel_layout
from paramsync.runtime.parallel.schedules import build_schedule, schedule_digest
from paramsync.runtime.protocol.messages import Go
from paramsync.runtime.transport.base import Transport

__all__ = ["CoordinatorStepHooks", "join_3d"]


async def join_3d(
    client: CoordinatorClient,
    rank: int,
    config: ParallelismConfig,
    spec: ModelSpec,
    address: tuple[str, int],
) -> JoinResult:
    """Join ``client`` as world rank ``rank`` of the 3D run ``config`` of ``spec``'s model."""
    schedule = build_schedule(
        config.pipeline_schedule.value,
        config.pp_size,
        config.num_micro_batches,
        config.virtual_chunks,
    )
    shape = dict(zip(config.mesh_names(), config.mesh_shape(), strict=True))
    layout = parallel_layout(rank, shape, schedule_digest(schedule))
    signature = model_signature(spec.dense().named_parameters())
    return await client.join(
        signature, address, layout=layout, mesh=(config.mesh_names(), config.mesh_shape())
    )


class CoordinatorStepHooks:
    """`StepHooks` that run each optimizer step through the coordinator's protocol.

    Build it before `CoordinatorClient.serve` runs (it takes the client's ``on_go``), after
    `join_3d`; ``epoch`` is the start's.
    """

    def __init__(self, client: CoordinatorClient, epoch: int) -> None:
        self.client = client
        self.epoch = epoch
        self._go_send, self._go_receive = trio.open_memory_channel[Go](16)
        self._sent_names = False
        self.commits = 0
        """Steps the coordinator committed (every shard's replicas agreed)."""
        client.on_go = self._on_go

    async def _on_go(self, go: Go) -> None:
        await self._go_send.send(go)

    async def before_reduce(self, step: int, dp_group: Transport, flat_numel: int) -> None:
        """Report the step's one bucket ready within the dp group; wait for its go."""
        name = dp_group.name if isinstance(dp_group, ProcessGroup) else ""
        spec = bucket_spec([torch.empty((flat_numel,), device="meta")])  # shape and dtype
        await self.client.ready(step, 0, spec, self.epoch, group=name)
        go = await self._go_receive.receive()
        if (go.step, go.bucket, go.group) != (step, 0, name):
            raise RuntimeError(
                f"the coordinator said go for step {go.step}, bucket {go.bucket}, group "
                f"{go.group!r}; this rank waits for step {step}, bucket 0, group {name!r}"
            )

    async def after_step(self, step: int, digest: StateDigest) -> None:
        """Report the shard digest; wait until the coordinator commits the step."""
        names = None if self._sent_names else digest.names
        self._sent_names = True
        await self.client.digest(
            step, digest.digest, digest.packed, self.epoch, names=names, algorithm=digest.algorithm
        )
        await self.client.wait_commit(step)
        self.commits += 1

    async def finish(self, steps: int) -> None:
        """Tell the coordinator this rank took its last step; wait for the run's end."""
        await self.client.finished(steps, self.epoch)
        await self.client.done.wait()
