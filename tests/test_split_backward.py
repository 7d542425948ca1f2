"""The zero-bubble split backward (`paramsync.actors.parallel.split_backward`): the input pass and
the weight pass give bitwise the gradients of one whole backward, and the weight pass never walks
the activation-gradient chain again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paramsync.actors.parallel.split_backward import backward_input
from tests.pipeline_fixtures import loss_fn, transformer_blocks


def _forward(chunk: nn.Module, x: torch.Tensor, target=None):
    """The chunk's parameters, its input (requiring grad when floating) and its output (the
    loss, for the last stage's ``target``)."""
    params = list(chunk.parameters())
    xi = x.clone().requires_grad_(x.is_floating_point())
    out = chunk(xi)
    if target is not None:
        out = loss_fn(out, target) / 4
    return params, xi, out


def _whole(chunk: nn.Module, x: torch.Tensor, grad: torch.Tensor | None, target=None):
    params, xi, out = _forward(chunk, x, target)
    wanted = ([xi] if xi.requires_grad else []) + params
    grads = torch.autograd.grad([out], wanted, None if grad is None else [grad], allow_unused=True)
    if xi.requires_grad:
        return grads[0], list(grads[1:])
    return None, list(grads)


def _split(chunk: nn.Module, x: torch.Tensor, grad: torch.Tensor | None, target=None):
    params, xi, out = _forward(chunk, x, target)
    input_grad, weights = backward_input(out, grad, xi if xi.requires_grad else None, params)
    del out
    return input_grad, weights.compute(), weights


def _assert_same(expected, got) -> None:
    (e_input, e_weights), (g_input, g_weights) = expected, got
    assert (e_input is None) == (g_input is None)
    if e_input is not None:
        assert torch.equal(e_input, g_input)
    assert len(e_weights) == len(g_weights)
    for index, (e, g) in enumerate(zip(e_weights, g_weights, strict=True)):
        assert (e is None) == (g is None), index
        if e is not None:
            assert torch.equal(e, g), f"parameter {index} differs"


def _mlp(width: int = 32, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))


def test_mlp_stage_is_bitwise_one_backward() -> None:
    chunk = _mlp()
    x, grad = torch.randn(8, 32), torch.randn(8, 32)
    input_grad, weight_grads, _ = _split(chunk, x, grad)
    _assert_same(_whole(chunk, x, grad), (input_grad, weight_grads))


@pytest.mark.parametrize("last", [False, True])
def test_transformer_stages_are_bitwise_one_backward(last: bool) -> None:
    blocks = transformer_blocks(4)
    chunk = nn.Sequential(*(blocks[3:] if last else blocks[1:3]))
    x = torch.randn(2, 6, 16)
    grad = None if last else torch.randn(2, 6, 16)
    target = torch.randint(0, 13, (2, 6)) if last else None
    input_grad, weight_grads, _ = _split(chunk, x, grad, target)
    _assert_same(_whole(chunk, x, grad, target), (input_grad, weight_grads))


class _Reused(nn.Module):
    """One Linear applied twice on the chain (its weight meets the chain at two joints), a
    parameter added at the output, and one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.other = nn.Linear(16, 16)
        self.offset = nn.Parameter(torch.randn(16))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        h = self.other(h) * 0.5
        return self.shared(h) + self.offset


def test_a_weight_used_twice_and_an_unused_one() -> None:
    torch.manual_seed(1)
    chunk = _Reused()
    x, grad = torch.randn(4, 16), torch.randn(4, 16)
    input_grad, weight_grads, _ = _split(chunk, x, grad)
    expected = _whole(chunk, x, grad)
    _assert_same(expected, (input_grad, weight_grads))
    unused = [i for i, p in enumerate(chunk.parameters()) if p is chunk.unused]
    assert [i for i, g in enumerate(weight_grads) if g is None] == unused


def test_an_input_without_grad_leaves_the_whole_backward_to_the_weight_pass() -> None:
    blocks = transformer_blocks(2)
    chunk = nn.Sequential(*blocks[:2])
    ids = torch.randint(0, 13, (2, 6))
    grad = torch.randn(2, 6, 16)
    input_grad, weight_grads, _ = _split(chunk, ids, grad)
    assert input_grad is None
    _assert_same(_whole(chunk, ids, grad), (None, weight_grads))


def test_the_weight_pass_does_not_walk_the_chain_again() -> None:
    """The ReLUs lie on the chain and own no weight: they run in the input pass only."""
    chunk = _mlp()
    x = torch.randn(8, 32, requires_grad=True)
    out = chunk(x)
    relus = []
    node = out.grad_fn
    while node is not None:
        if "Relu" in type(node).__name__:
            relus.append(node)
        nexts = [n for n, _ in node.next_functions if n is not None and "Accumulate" not in str(n)]
        nexts = [n for n in nexts if "TBackward" not in type(n).__name__]
        node = nexts[0] if nexts else None
    assert len(relus) == 4
    calls = {"input": 0, "weight": 0}
    phase = "input"

    def count(_grads):
        calls[phase] += 1

    handles = [relu.register_prehook(count) for relu in relus]
    _, weights = backward_input(out, torch.randn(8, 32), x, list(chunk.parameters()))
    phase = "weight"
    grads = weights.compute()
    for handle in handles:
        handle.remove()
    assert calls == {"input": 4, "weight": 0}
    assert all(g is not None for g in grads)
    with pytest.raises(RuntimeError, match="already computed"):
        weights.compute()
