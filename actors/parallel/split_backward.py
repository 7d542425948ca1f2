"""Zero-bubble's split backward: the input gradient now, the weight gradients later, for the
price of one backward.

A stage's backward computes two things: the gradient of its input (which the previous stage is
waiting for) and the gradients of its weights (which nobody waits for). ZB-H1 runs them as two
actions, I and W, to fill the pipeline's bubbles with W's. That only pays if I + W costs what
one B does: W must not walk the activation-gradient chain (output -> ... -> input) a second
time.

`backward_input` therefore looks at the chunk's autograd graph once:

- the *chain*: every node on a path from the output to the stage input;
- the *joints*: the chain nodes where a parameter's own subgraph (its AccumulateGrad and the
  nodes only it reaches, e.g. a transpose) hangs off the chain: a Linear's addmm, a norm;
- *groups*: parameters that meet the chain at a common joint (their gradients are computed
  together, so a parameter used at two joints is summed by autograd as in a whole backward).

It runs autograd from the output to the input alone (each chain node computes only the
gradient that flows to the input: an addmm computes ``grad @ W``, not ``x.T @ grad``) while a
pre-hook on every joint keeps the gradients that flowed into it. `WeightGradients.compute`
later starts autograd at the joints with those kept gradients and asks for the parameters
only: each joint computes only its parameter outputs and nothing walks the chain again. This
is what torch.distributed.pipelining's ``stage_backward_input`` / ``stage_backward_weight``
do. The gradients are the very tensors one whole backward gives (the same nodes run the same
kernels on the same incoming gradients), so pipeline parity stays bitwise.

When the output does not depend on a stage input that requires grad (stage 0, whose input is
data), there is nothing to split: the input pass does nothing and the weight pass is the whole
backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradients", "backward_input"]


def _graph_parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root`` (``root`` included) -> the nodes that feed it a
    gradient (whose next_functions name it)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _ancestors(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """The nodes from which ``start`` is reached (``start`` included), not going past ``stop``
    nodes (they are collected but not expanded)."""
    seen = {start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node in stop and node is not start:
            continue
        for parent in parents.get(node, ()):
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen


@dataclass
class _Group:
    """Parameters (their indices) whose subgraphs meet the chain at ``joints``."""

    params: list[int]
    joints: list[Node]


@dataclass
class WeightGradients:
    """What `backward_input` leaves for the weight pass; `compute` gives the gradients once."""

    params: list[torch.Tensor]
    groups: list[_Group] = field(default_factory=list)
    saved: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    unsplit_output: torch.Tensor | None = None
    """Set when nothing was split: the weight pass is a whole backward from this output."""
    unsplit_grad: torch.Tensor | None = None
    _done: bool = False

    def compute(self) -> list[torch.Tensor | None]:
        """The weight gradients, one per parameter (None: the output does not depend on it),
        from the gradients kept at the joints; frees the kept graph. Once only."""
        if self._done:
            raise RuntimeError("the weight gradients of this backward were already computed")
        self._done = True
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        try:
            if self.unsplit_output is not None:
                wanted = [i for i, p in enumerate(self.params) if p.requires_grad]
                if wanted:
                    found = torch.autograd.grad(
                        [self.unsplit_output],
                        [self.params[i] for i in wanted],
                        None if self.unsplit_grad is None else [self.unsplit_grad],
                        allow_unused=True,
                    )
                    for i, g in zip(wanted, found, strict=True):
                        grads[i] = g
                return grads
            for group in self.groups:
                self._compute_group(group, grads)
            return grads
        finally:
            self.groups.clear()
            self.saved.clear()
            self.unsplit_output = None
            self.unsplit_grad = None

    def _compute_group(self, group: _Group, grads: list[torch.Tensor | None]) -> None:
        roots: list[GradientEdge] = []
        incoming: list[torch.Tensor] = []
        for joint in group.joints:
            for index, grad in enumerate(self.saved.get(joint, ())):
                if grad is not None:
                    roots.append(GradientEdge(joint, index))
                    incoming.append(grad)
        if not roots:
            return  # no gradient reached these joints: the parameters' gradients are None
        handles = []
        if len(group.joints) > 1:
            # One joint may lie below another on the chain: autograd would then add the upper
            # joint's contribution to the lower one's kept gradient. Pin each joint's incoming
            # gradients to the kept ones (torch's stage_backward_weight does the same).
            for joint in group.joints:
                kept = self.saved.get(joint)
                if kept is not None:
                    handles.append(joint.register_prehook(lambda _grads, kept=kept: kept))
        try:
            found = torch.autograd.grad(
                roots,
                [get_gradient_edge(self.params[i]) for i in group.params],
                incoming,
                retain_graph=True,  # groups may share chain nodes below their joints
                allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        for i, g in zip(group.params, found, strict=True):
            grads[i] = g


def _split_groups(
    parents: dict[Node, list[Node]], chain: set[Node], params: Sequence[torch.Tensor]
) -> list[_Group]:
    """Group the parameters by the joints where their subgraphs meet the chain."""
    joint_owner: dict[Node, int] = {}  # joint -> index into groups
    groups: list[_Group | None] = []
    for index, param in enumerate(params):
        if not param.requires_grad:
            continue
        node = get_gradient_edge(param).node
        if node not in parents:
            continue  # the output does not depend on it
        joints = sorted(
            (n for n in _ancestors(node, parents, chain) if n in chain),
            key=lambda n: -n._sequence_nr(),
        )
        if not joints:  # every node reached from the output reaches the chain's top
            raise RuntimeError(
                f"parameter {index} ({tuple(param.shape)}) reaches the output without meeting "
                "the input's gradient chain: cannot split its backward"
            )
        merged = sorted({joint_owner[j] for j in joints if j in joint_owner})
        target = _Group([index], list(joints))
        for owner in merged:
            other = groups[owner]
            assert other is not None
            target.params = other.params + target.params
            target.joints = other.joints + [j for j in target.joints if j not in other.joints]
            groups[owner] = None
        groups.append(target)
        for joint in target.joints:
            joint_owner[joint] = len(groups) - 1
    return [group for group in groups if group is not None]


def backward_input(
    output: torch.Tensor,
    grad_output: torch.Tensor | None,
    stage_input: torch.Tensor | None,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, WeightGradients]:
    """The gradient of ``stage_input`` (None when it does not require grad or the output does
    not depend on it) from ``output`` with ``grad_output`` (None: ``output`` is a scalar loss),
    and what the weight pass needs to give ``params``' gradients without walking the chain
    again. The graph is kept for that pass; the caller drops ``output`` afterwards."""
    params = list(params)
    root = output.grad_fn
    if root is None or stage_input is None or not stage_input.requires_grad:
        return None, WeightGradients(params, unsplit_output=output, unsplit_grad=grad_output)
    parents = _graph_parents(root)
    input_node = get_gradient_edge(stage_input).node
    if input_node not in parents:
        return None, WeightGradients(params, unsplit_output=output, unsplit_grad=grad_output)
    chain = _ancestors(input_node, parents, set())
    chain.discard(input_node)
    groups = _split_groups(parents, chain, params)
    weights = WeightGradients(params, groups)
    handles = []

    def keep(joint: Node):
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            weights.saved[joint] = tuple(grads)

        return hook

    try:
        for group in groups:
            for joint in group.joints:
                handles.append(joint.register_prehook(keep(joint)))
        (input_grad,) = torch.autograd.grad(
            [output],
            [stage_input],
            None if grad_output is None else [grad_output],
            retain_graph=True,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    return input_grad, weights
