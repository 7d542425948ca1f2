"""The built-in training job: a character-level transformer LM on CPython's own sources.

Run one rank per process (``paramsync launch --nproc 4 -- -m paramsync.actors.demo_job.job``, or
``paramsync worker`` with a coordinator started by hand). Rank 0 shows a progress bar; every
rank records its actors' spans for the Chrome trace; at the end the ranks gather their loss
curves, rank 0 plots them, and every rank writes its summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

import torch
import trio

from paramsync.actors.demo_job.corpus import load_char_dataset
from paramsync.actors.demo_job.model import CharTransformer
from paramsync.actors.state.buckets import DEFAULT_BUCKET_BYTES
from paramsync.actors.state.checkpoint import CheckpointError, CheckpointStore, new_run_id
from paramsync.actors.state.training_state import capture_state, restore_state
from paramsync.actors.train.checkpointing import CommittedCheckpoints
from paramsync.actors.train.run import run_script, trainer_from_env, write_summary
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.runtime.cli.torchrun import RUN_ID_ENV, run_id_from_env
from paramsync.runtime.collectives.ring import all_gather
from paramsync.runtime.coordinator.service import CoordinatorOptions
from paramsync.runtime.errors import pick_error
from paramsync.runtime.observe.plot import write_loss_plot
from paramsync.runtime.observe.progress import ProgressBar
from paramsync.runtime.observe.trace import TraceRecorder

__all__ = ["main", "build_parser", "run", "RUN_ID_ENV"]

log = logging.getLogger("paramsync.lm_job")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of the LM job (shared by ``paramsync worker``)."""
    parser = parser or argparse.ArgumentParser(prog="python -m paramsync.actors.demo_job.job")
    group = parser.add_argument_group("training job")
    group.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    group.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    group.add_argument("--context", type=int, default=64)
    group.add_argument("--d-model", type=int, default=128)
    group.add_argument("--layers", type=int, default=2)
    group.add_argument("--heads", type=int, default=4)
    group.add_argument("--lr", type=float, default=3e-3)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--corpus-bytes", type=int, default=2 << 20)
    group.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    group.add_argument("--accumulation-steps", type=int, default=1)
    group.add_argument("--digest-interval", type=int, default=1)
    group.add_argument("--config", help="TOML file with a [distributed] table")
    group.add_argument("--trace", help="write this rank's Chrome trace here ({rank} expands)")
    group.add_argument("--plot", help="rank 0 writes the loss-curve PNG here")
    group.add_argument("--summary-json", help="write this rank's summary here ({rank} expands)")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument(
        "--checkpoint-dir",
        help="rank 0 writes atomic safetensors checkpoints of the whole state here",
    )
    group.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (0: only at stop); a checkpoint is written once its "
        "step is committed (every rank's digest agreed), never before",
    )
    group.add_argument(
        "--run-id",
        help="the run id recorded in every checkpoint (default: $PARAMSYNC_RUN_ID, set by "
        "paramsync launch on one node, else torchrun's $TORCHELASTIC_RUN_ID, else the "
        "coordinator's, random; with --resume: the one recorded in --checkpoint-dir)",
    )
    group.add_argument(
        "--reconnect-seconds",
        type=float,
        default=60.0,
        help="if the coordinator is lost, keep the state and redial it this long, then "
        "rejoin where the workers stand (0: a lost coordinator ends the run; default "
        "%(default)s)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="every worker restores the newest committed checkpoint of this run (its run id "
        "recorded in --checkpoint-dir) first; other runs' checkpoints are refused",
    )
    return parser


async def run(args: argparse.Namespace) -> int:
    """Train with ``args``; returns the exit code."""
    torch.manual_seed(args.seed)
    vocab, dataset = load_char_dataset(args.context, max_bytes=args.corpus_bytes)
    model = CharTransformer(
        len(vocab), args.d_model, args.heads, args.layers, args.context, seed=args.seed
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    options = TrainerOptions(
        bucket_bytes=args.bucket_bytes,
        accumulation_steps=args.accumulation_steps,
        max_steps=args.steps,
        digest_interval=args.digest_interval,
    )
    rank = int(os.environ.get("RANK", "0"))
    store: CheckpointStore | None = None
    resume_step = 0
    if args.resume and not args.checkpoint_dir:
        log.error("--resume needs --checkpoint-dir")
        return EXIT_USAGE
    store_run_id_given = False
    if args.checkpoint_dir:
        try:
            store, store_run_id_given = _open_store(args, rank)
            state = store.load_latest_valid(committed_only=True) if args.resume else None
        except (CheckpointError, ValueError) as exc:
            log.error("rank %d: %s", rank, exc)
            return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED
        if args.resume and state is None:
            log.warning("rank %d: no checkpoint in %s, starting afresh", rank, args.checkpoint_dir)
        elif state is not None:
            restore_state(model, optimizer, state)
            resume_step = state.step
            log.info("rank %d resumes from the checkpoint of step %d", rank, resume_step)
    trace = TraceRecorder(f"rank {rank}", pid=rank) if args.trace else TraceRecorder.disabled()
    stop: dict[str, int | None] = {"signal": None}

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        assert isinstance(model, CharTransformer)
        return model.loss(inputs, targets)

    try:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        stop["signal"] = signum
                        log.warning(
                            "rank %d: %s, stopping after the step in flight",
                            rank,
                            signal.Signals(signum).name,
                        )

            nursery.start_soon(watch_signals)
            coordinator_options = CoordinatorOptions(digest_interval=args.digest_interval)
            async with trainer_from_env(
                model,
                optimizer,
                loss_fn,
                options=options,
                coordinator_options=coordinator_options,
                trace=trace,
                toml_path=args.config,
                resume_step=resume_step,
                resume_committed=resume_step > 0,  # loaded with committed_only=True
                reconnect_seconds=args.reconnect_seconds or None,
            ) as trainer:
                rank = trainer.dist_config.rank
                if store is not None and not store_run_id_given and trainer.run_id:
                    # No run id given (a multi-node launch): the coordinator's, which every
                    # worker of the run receives alike.
                    store = CheckpointStore(args.checkpoint_dir, run_id=trainer.run_id)
                    log.info(
                        "rank %d: checkpoints of run %r (the coordinator's)", rank, store.run_id
                    )
                bar = (
                    ProgressBar(args.steps, description=f"training ({trainer.world_size} workers)")
                    if rank == 0 and args.progress
                    else None
                )

                writer = (
                    CommittedCheckpoints(
                        store,
                        trainer.run.client.wait_commit,
                        replaced=lambda: trainer.run.states_received,
                    )
                    if store is not None
                    else None
                )
                if writer is not None:
                    nursery.start_soon(writer.run)

                def save_checkpoint() -> None:
                    """Offer the state to the writer, which writes it once it is committed."""
                    if writer is not None and trainer.supervisor.position == 0:
                        assert store is not None
                        if store.recorded_run_id() != store.run_id:
                            store.record_run_id()
                        writer.offer(capture_state(model, optimizer, trainer.step))

                def on_step(step: int, loss: float) -> None:
                    if bar is not None:
                        bar.update(step + 1, loss=loss)
                    if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                        save_checkpoint()

                await trainer.fit(
                    dataset,
                    args.batch_size,
                    seed=args.seed,
                    on_step=on_step,
                    should_stop=lambda: stop["signal"] is not None,
                )
                if bar is not None:
                    bar.close()
                if writer is not None:
                    await trainer.verified()  # on SIGTERM/SIGINT: the last committed state
                    if stop["signal"] is not None or not args.checkpoint_every:
                        save_checkpoint()
                    await writer.flush()
                if stop["signal"] is None and args.plot:
                    await _gather_and_plot(trainer, args)
                summary = trainer.summary()
            nursery.cancel_scope.cancel()
    except BaseException as exc:
        if stop["signal"] is None:
            raise
        # Stopped by a signal: the run's end (an abort, a hang-up) is the expected echo.
        log.warning(
            "rank %d stopped by %s: %s", rank, signal.Signals(stop["signal"]).name, pick_error(exc)
        )
        return _exit_code(stop["signal"])
    if args.trace:
        path = trace.write(args.trace.format(rank=rank))
        log.info("rank %d wrote its trace to %s", rank, path)
    if args.summary_json:
        write_summary(args.summary_json.format(rank=rank), summary)
    return _exit_code(stop["signal"])


def _open_store(args: argparse.Namespace, rank: int) -> tuple[CheckpointStore, bool]:
    """The checkpoint store of this run, and whether its run id was given: on --resume, the
    one recorded in the directory (or --run-id); on a fresh run, --run-id, $PARAMSYNC_RUN_ID or
    torchrun's $TORCHELASTIC_RUN_ID. With none given, a random one until the coordinator's
    arrives (`run` takes it then)."""
    found = CheckpointStore(args.checkpoint_dir)
    given = args.run_id or run_id_from_env()
    if args.resume:
        recorded = args.run_id or found.recorded_run_id()
        if recorded is None and found.checkpoints():
            raise CheckpointError(
                f"{args.checkpoint_dir}: no run id recorded for its checkpoints; pass "
                "--run-id to say which run to resume"
            )
        given = recorded or given
    if given is not None:
        log.info("rank %d: checkpoints of run %r in %s", rank, given, args.checkpoint_dir)
    else:
        log.info("rank %d: checkpoints in %s, of the coordinator's run", rank, args.checkpoint_dir)
    return CheckpointStore(args.checkpoint_dir, run_id=given or new_run_id()), given is not None


def _exit_code(signum: int | None) -> int:
    if signum == signal.SIGINT:
        return EXIT_INTERRUPTED
    if signum == signal.SIGTERM:
        return EXIT_TERMINATED
    return EXIT_OK


async def _gather_and_plot(trainer: DistributedTrainer, args: argparse.Namespace) -> None:
    losses = torch.tensor([loss for _, loss in trainer.run.history.losses], dtype=torch.float64)
    curves = await all_gather(trainer.supervisor.live_epoch().transport, losses)
    if trainer.dist_config.rank == 0 and args.plot:
        steps = [step for step, _ in trainer.run.history.losses]
        series = {f"rank {r}": list(zip(steps, curves[r].tolist())) for r in range(curves.shape[0])}
        series["mean over ranks"] = list(zip(steps, curves.mean(0).tolist()))
        write_loss_plot(
            args.plot,
            series,
            title="paramsync: char-level LM on CPython sources",
            smoothing=0.9,
            highlight="mean over ranks",
        )
        log.info("wrote the loss curve to %s", args.plot)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m paramsync.actors.demo_job.job``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_script(run, args)  # a configuration error: one line, exit code 2


if __name__ == "__main__":
    sys.exit(main())
