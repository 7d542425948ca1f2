"""Dropout randomness under tensor parallelism: one generator per tp rank inside the region.

As Megatron's ``tensor_parallel/random.py``: activations inside the tensor-parallel region (the
attention probabilities of this rank's heads) are different tensors on each tp rank, so their
dropout masks must come from a generator seeded per rank, ``seed + 2718 + tp_rank``; activations
outside it (the replicated hidden state after a row-parallel reduce) are the same tensor on every
tp rank and must drop the same elements, so their masks come from the default generator, seeded
``seed`` alike on every tp rank (and Megatron PR 206: nothing else may draw from it on one tp
rank only).

`TensorParallelRNG` holds both generators. ``with rng.fork():`` switches `dropout` to the
model-parallel generator; `get_states`/`set_states` save and restore both, so activation
checkpointing can replay a forward with the very same masks. Masks are drawn with an explicit
``torch.Generator``, never torch's process-wide one, so ranks running as threads of one process
(the in-process tests) do not share a generator; pass ``default_generator=torch.default_generator``
to make the region outside the tp region use the process's own generator, as Megatron does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["TensorParallelRNG", "MODEL_PARALLEL_SEED_OFFSET", "model_parallel_seed"]

MODEL_PARALLEL_SEED_OFFSET = 2718
"""Megatron's offset of the tensor-parallel region's seed from the run's seed."""

_DEFAULT = "default"
_MODEL_PARALLEL = "model-parallel-rng"


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """The seed of tp rank ``tp_rank``'s generator inside the tensor-parallel region."""
    return seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank


class TensorParallelRNG:
    """The dropout generators of one tp rank: default outside the region, its own inside."""

    def __init__(
        self, seed: int, tp_rank: int, *, default_generator: torch.Generator | None = None
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
            raise ValueError(f"tp_rank must be a non-negative int, got {tp_rank!r}")
        self.seed = seed
        self.tp_rank = tp_rank
        if default_generator is None:
            default_generator = torch.Generator().manual_seed(seed)
        self._generators = {
            _DEFAULT: default_generator,
            _MODEL_PARALLEL: torch.Generator().manual_seed(model_parallel_seed(seed, tp_rank)),
        }
        self._current = _DEFAULT

    @property
    def in_tp_region(self) -> bool:
        """Whether `dropout` draws from the model-parallel generator now."""
        return self._current == _MODEL_PARALLEL

    def generator(self) -> torch.Generator:
        """The generator `dropout` draws from now."""
        return self._generators[self._current]

    @contextmanager
    def fork(self) -> Iterator[TensorParallelRNG]:
        """Draw from this tp rank's model-parallel generator inside the block."""
        previous, self._current = self._current, _MODEL_PARALLEL
        try:
            yield self
        finally:
            self._current = previous

    def get_states(self) -> dict[str, torch.Tensor]:
        """Both generators' states (copies), for `set_states`."""
        return {name: gen.get_state() for name, gen in self._generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore the states `get_states` returned."""
        if set(states) != set(self._generators):
            raise ValueError(
                f"RNG states name {sorted(states)}, this tracker holds {sorted(self._generators)}"
            )
        for name, state in states.items():
            self._generators[name].set_state(state)

    def dropout(self, x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        """Inverted dropout of ``x`` with probability ``p``, the mask drawn from `generator`."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1), got {p!r}")
        if not training or p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=self.generator())
        return x * keep / (1.0 - p)

    def __repr__(self) -> str:
        region = "tp region" if self.in_tp_region else "default"
        return f"TensorParallelRNG(seed {self.seed}, tp rank {self.tp_rank}, drawing {region})"
