"""The line that tells a user, once, what the identical-state proof covers and what it does not.

The proof (`paramsync.actors.torch_backend.proof`) compares only what torch keeps identical
(`paramsync.actors.torch_backend.proof_targets`): this line says so at an optimizer's first
step, on global rank 0, so that state left out (FSDP's shards, a rank-local head) is never
mistaken for proven state.
"""

from __future__ import annotations

from typing import Any

from paramsync.actors.torch_backend.proof_targets import Plan

__all__ = ["notice"]


def _ranks(group: Any) -> str:
    ranks = getattr(group, "global_ranks", None)
    return f"ranks {list(ranks)}" if ranks is not None else "its ranks"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def notice(plan: Plan) -> str:
    """One line: what ``plan`` proves after every optimizer step, and what it leaves out."""
    proven = []
    for module, group in plan.ddp:
        params = _count(sum(1 for _ in module.parameters()), "parameter")
        proven.append(
            f"a torch DDP module ({params}, its buffers and their optimizer state) across "
            f"{_ranks(group)}"
        )
    for entry in plan.replicated:
        replicas = " and ".join(str(ranks) for ranks in entry.replicas)
        params = _count(len(entry.params), "DTensor parameter")
        proven.append(
            f"{params} replicated over mesh dimension {entry.dimension} and their optimizer "
            f"state, across ranks {replicas}"
        )
    text = "paramsync: the identical-state proof (C-DDP-001) compares after every optimizer step: "
    text += "; ".join(proven) if proven else "nothing"
    if plan.unproven:
        left = [_count(count, "parameter") + f" {why}" for why, count in plan.unproven.items()]
        text += ". Not proven: " + "; ".join(left)
    return text + "."
