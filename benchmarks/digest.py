"""What the identical-weights check's hash costs where it runs: right after an optimizer step.

Trains the benchmark's character transformer (AdamW, one intra-op thread) and, after each
optimizer step, times one of three ways of hashing the state, in turn, so all three see the
same cold caches an optimizer step leaves behind (hashing the same state in a hot loop costs
half as much, and is not what a training step pays):

- ``hasher``: a `StateHasher` reused step after step, as the trainer does;
- ``fresh``: `state_digest`, a new hasher each time (the full walk of the model and
  optimizer, every tensor's byte view rebuilt);
- ``bytes only``: XXH3 over the same tensors' bytes, nothing else: the floor.

It reports each one's median thread CPU time (and the optimizer step's, for scale), also
as a multiple of the bytes-only floor, which drifts less with the machine's speed; and, in the
same rotation, a `StateHasher` forced to the fold (docs/digest.md) on the CPU, which is what
``state_digest="auto"`` weighs XXH3 against for a CPU state. To compare with an older commit,
copy this file into a worktree of it and run it there.

    python benchmarks/digest.py --steps 300

``--state-params N`` times instead both algorithms over a synthetic state of N float32
parameters (tensors of 4 Mi elements, no optimizer), a few digests each, wall and thread CPU:

    python benchmarks/digest.py --state-params 100000000

``--device`` (``cpu`` or ``cuda``) times instead the digest the trainer takes after each step on
that device (``state_digest="auto"``: the fold for a device state, XXH3 on the CPU) against the
training step itself, of the demo model or, with ``--params SIZE`` (``100M``), a stack of
linear layers of about that many parameters; and counts the bytes the digest copies to the host
through the device operations. Its JSON holds ``step_seconds`` and ``digest_seconds`` (medians)
and ``host_bytes`` (a digest's), what ``make gpu-check``'s row (c) reads:

    python benchmarks/digest.py --device cuda --params 100M --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import xxhash  # noqa: E402

from paramsync.actors.demo_job.model import CharTransformer  # noqa: E402
from paramsync.actors.state.digest import StateHasher, named_state, state_digest  # noqa: E402
from paramsync.actors.state.fold_digest import DIGEST_PURPOSE  # noqa: E402
from paramsync.runtime.transport.device_ops import (  # noqa: E402
    CudaDeviceOps,
    device_ops_in_context,
)


def measure(steps: int, d_model: int, layers: int, context: int, batch: int) -> dict:
    """Median thread CPU seconds of each way of hashing, right after an optimizer step."""
    torch.set_num_threads(1)
    model = CharTransformer(97, d_model, 4, layers, context, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 97, (batch, context), generator=torch.Generator().manual_seed(0))
    hasher = StateHasher(algorithm="xxh3")
    folder = StateHasher(algorithm="fold")
    views: list = []

    def bytes_only() -> None:
        for view in views:
            xxhash.xxh3_128_digest(view)

    ways = {
        "hasher": lambda: hasher.digest(model, optimizer),
        "fresh": lambda: state_digest(model, optimizer),
        "bytes only": bytes_only,
        "fold": lambda: folder.digest(model, optimizer),
    }
    spent: dict[str, list[float]] = {name: [] for name in (*ways, "optimizer step")}
    warmup = 5
    for step in range(warmup + steps):
        model.loss(tokens, tokens).backward()
        started = time.thread_time()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        stepped = time.thread_time()
        if not views:
            views = [tensor.numpy() for _, tensor in named_state(model, optimizer)]
        name = list(ways)[(step - warmup) % len(ways)]
        ways[name]()
        done = time.thread_time()
        if step >= warmup:
            spent["optimizer step"].append(stepped - started)
            spent[name].append(done - stepped)
    state_bytes = sum(view.nbytes for view in views)
    fold = spent.pop("fold")
    return {
        "state_bytes": state_bytes,
        "tensors": len(views),
        "median_cpu_seconds": {name: statistics.median(v) for name, v in spent.items()},
        "fold_median_cpu_seconds": statistics.median(fold) if fold else None,
    }


def measure_state(params: int, repeats: int) -> dict:
    """Median wall and thread CPU seconds of each algorithm's digest of ``params`` float32
    parameters (one intra-op thread)."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    chunk = 1 << 22
    sizes = [min(chunk, params - start) for start in range(0, params, chunk)]
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(size, generator=generator)) for size in sizes
    )
    figures: dict[str, dict[str, float]] = {}
    for name in ("xxh3", "fold"):
        hasher = StateHasher(algorithm=name)
        hasher.digest(model)  # the layout's first walk and tables
        walls, cpus = [], []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.thread_time()
            hasher.digest(model)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
        figures[name] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    return {"params": params, "tensors": len(sizes), "seconds": figures}


class _CountingOps(CudaDeviceOps):
    """CUDA's device operations, adding up the bytes the digest copies to the host."""

    def __init__(self) -> None:
        self.digest_bytes = 0

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream, purpose: str):  # type: ignore[no-untyped-def]
        if purpose == DIGEST_PURPOSE:
            self.digest_bytes += src.numel() * src.element_size()
        return super().copy_to_host(src, dst, stream, purpose)


def parse_size(text: str) -> int:
    """``100M``, ``417k``, ``2G`` or a plain count, as a number of parameters."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _linear_stack(params: int) -> torch.nn.Module:
    """Linear layers (with biases) adding up to about ``params`` parameters: 4096 wide, or
    narrower for a small model (one square layer)."""
    width = min(4096, max(16, int(params**0.5)))
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def measure_device(device: str, params: int | None, steps: int, batch: int) -> dict:
    """Median seconds of a training step and of the digest the trainer takes after it, on
    ``device`` (each timed alone, the device drained before and after: a benchmark's
    synchronize, not the trainer's), and the bytes one digest copies to the host."""
    where = torch.device(device)
    if params is None:
        model: torch.nn.Module = CharTransformer(97, 128, 4, 2, 64, seed=0).to(where)
        tokens = torch.randint(0, 97, (batch, 64), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(where)

        def loss() -> torch.Tensor:
            return model.loss(tokens, tokens)  # type: ignore[operator]
    else:
        model = _linear_stack(params).to(where)
        width = model[0].in_features  # type: ignore[index]
        inputs = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
        inputs = inputs.to(where)

        def loss() -> torch.Tensor:
            return model(inputs).square().mean()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ops = _CountingOps()
    hasher = StateHasher()  # "auto", as the trainer
    drain = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
    step_times, digest_times, host_bytes, algorithm = [], [], [], ""
    with device_ops_in_context(ops):
        for step in range(3 + steps):
            drain()
            started = time.perf_counter()
            loss().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            drain()
            stepped = time.perf_counter()
            before = ops.digest_bytes
            digest = hasher.start(model, optimizer).result()
            drain()
            done = time.perf_counter()
            algorithm = digest.algorithm
            if step >= 3:
                step_times.append(stepped - started)
                digest_times.append(done - stepped)
                host_bytes.append(ops.digest_bytes - before)
    count = sum(p.numel() for p in model.parameters())
    return {
        "device": device,
        "params": count,
        "algorithm": algorithm,
        "step_seconds": statistics.median(step_times),
        "digest_seconds": statistics.median(digest_times),
        "host_bytes": statistics.median(host_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--state-params", type=int, help="time both algorithms on this many float32 parameters"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="time the trainer's digest against its step there"
    )
    parser.add_argument("--params", type=parse_size, help="with --device: a model of this size")
    args = parser.parse_args()
    if args.params is not None and args.device is None:
        raise SystemExit("--params needs --device")
    if args.device is not None:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch.cuda.is_available() is False")
        figures = measure_device(args.device, args.params, args.steps, args.batch_size)
        share = figures["digest_seconds"] / figures["step_seconds"]
        print(
            f"{figures['params']} parameters on {figures['device']} ({figures['algorithm']}): "
            f"step {figures['step_seconds'] * 1e3:.2f} ms, digest "
            f"{figures['digest_seconds'] * 1e3:.3f} ms ({share * 100:.2f} % of the step), "
            f"{int(figures['host_bytes'])} bytes to the host a digest"
        )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(figures, indent=2))
        return
    if args.state_params is not None:
        state = measure_state(args.state_params, args.repeats)
        print(f"state: {state['params']} float32 parameters in {state['tensors']} tensors")
        for name, figures in state["seconds"].items():
            wall, cpu = figures["wall"] * 1e3, figures["cpu"] * 1e3
            print(f"  {name:>5}: {wall:9.1f} ms wall, {cpu:9.1f} ms CPU")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(state, indent=2))
        return
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (one for each way of hashing)")
    result = measure(args.steps, args.d_model, args.layers, args.context, args.batch_size)
    print(
        f"state: {result['tensors']} tensors, {result['state_bytes'] / 2**20:.2f} MiB; "
        f"median thread CPU after each optimizer step, {args.steps} steps in turn:"
    )
    floor = result["median_cpu_seconds"]["bytes only"]
    for name, seconds in result["median_cpu_seconds"].items():
        # Against the floor too: the machine's speed drifts between runs, the ratio less.
        print(f"  {name:>14}: {seconds * 1e6:8.0f} us  ({seconds / floor:.2f}x bytes only)")
    fold = result["fold_median_cpu_seconds"]
    if fold is not None:
        print(f"  {'fold (on CPU)':>14}: {fold * 1e6:8.0f} us  ({fold / floor:.2f}x bytes only)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
