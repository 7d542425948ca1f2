"""paramsync.actors.state.digest: the state digests behind the C-DDP-001 check.

* A `StateHasher` reused step after step (its cached byte views) gives exactly the digest a
  fresh hash of the same state gives, through optimizer steps, swapped and resized storage,
  optimizer state appearing and disappearing, non-contiguous tensors, scalar optimizer state
  and bfloat16; it skips its per-tensor walk while the layout holds and takes it again after
  any change to it (new or swapped state, a reload, new, renamed, swapped, removed or retyped
  parameters, new or swapped buffers, a module added deep in the tree, other strides over the
  same storage).
* Any single flipped bit changes the whole digest and exactly that tensor's digest
  (hypothesis); names, shapes and dtypes are mixed in, so equal bytes in another layout differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import paramsync.actors.state.digest as digest_module
from paramsync.actors.state.digest import StateHasher, named_state, state_digest


def _replica(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        dtype = next(model.parameters()).dtype
        model(torch.randn(5, 4, dtype=dtype)).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_reused_hasher_equals_fresh_digest_through_steps() -> None:
    model, optimizer = _replica()
    hasher = StateHasher()
    seen = set()
    for _ in range(4):
        reused = hasher.digest(model, optimizer)
        fresh = state_digest(model, optimizer)
        assert reused.digest == fresh.digest
        assert reused.tensors == fresh.tensors
        seen.add(reused.digest)
        _train(model, optimizer)
    assert len(seen) == 4  # every step changed the state, and the digest saw it


def test_names_follow_named_state() -> None:
    model, optimizer = _replica()
    _train(model, optimizer)
    digest = StateHasher().digest(model, optimizer)
    # The tensors named_state lists, then the non-tensor parts (the param-group hyperparameters).
    assert [name for name, _ in digest.tensors] == [
        name for name, _ in named_state(model, optimizer)
    ] + ["optim/param_groups"]
    assert all(len(value) == 16 for _, value in digest.tensors)
    assert len(digest.digest) == 16
    # The packed form the coordinator receives: the same digests, concatenated, in order.
    assert digest.names == tuple(name for name, _ in digest.tensors)
    assert digest.packed == b"".join(value for _, value in digest.tensors)
    assert digest.digest == xxhash.xxh3_128_digest(digest.packed)


def test_names_stay_the_same_object_while_the_layout_holds() -> None:
    """The trainer lists the names only when they change, by identity: cheap every step."""
    model, optimizer = _replica()
    hasher = StateHasher()
    before = hasher.digest(model, optimizer).names
    _train(model, optimizer)  # Adam's state appears: new names
    first = hasher.digest(model, optimizer).names
    assert first != before
    _train(model, optimizer)
    assert hasher.digest(model, optimizer).names is first


def test_swapped_and_resized_storage_is_never_hashed_stale() -> None:
    model, optimizer = _replica()
    _train(model, optimizer)
    hasher = StateHasher()
    before = hasher.digest(model, optimizer)
    weight = model[0].weight
    weight.data = weight.data.clone() + 1  # same Parameter object, new storage
    swapped = hasher.digest(model, optimizer)
    assert swapped.digest != before.digest
    assert swapped == state_digest(model, optimizer)
    bias = model[2].bias
    pointer = bias.data_ptr()
    bias.data = bias.data[:2]  # same storage pointer, fewer elements: the layout changed
    assert bias.data_ptr() == pointer
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer)
    assert hasher.digest(model, optimizer) != swapped


def test_optimizer_state_appearing_and_vanishing() -> None:
    model, optimizer = _replica()
    hasher = StateHasher()
    empty = hasher.digest(model, optimizer)
    assert all(name.startswith("param/") for name, _ in empty.tensors[:-1])
    assert empty.tensors[-1][0] == "optim/param_groups"  # no per-parameter state yet
    _train(model, optimizer)
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer)
    optimizer.state.clear()
    cleared = hasher.digest(model, optimizer)
    assert cleared == state_digest(model, optimizer)
    assert len(cleared.tensors) == len(empty.tensors)


def test_scalar_and_non_contiguous_state() -> None:
    model, optimizer = _replica()
    _train(model, optimizer)
    first = model[0].weight
    optimizer.state[first]["scalar"] = 3.5  # a plain float, as some optimizers keep
    optimizer.state[first]["strided"] = torch.arange(12.0).view(3, 4).t()  # not contiguous
    hasher = StateHasher()
    once = hasher.digest(model, optimizer)
    assert once == state_digest(model, optimizer) == hasher.digest(model, optimizer)
    optimizer.state[first]["scalar"] = 3.25
    assert hasher.digest(model, optimizer) != once
    optimizer.state[first]["scalar"] = 3.5
    optimizer.state[first]["strided"].t()[0, 0] = 99.0  # writes through to the base
    assert hasher.digest(model, optimizer) != once


def test_bfloat16_state() -> None:
    model, optimizer = _replica(dtype=torch.bfloat16)
    _train(model, optimizer, steps=2)
    hasher = StateHasher()
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer)
    with torch.no_grad():
        model[0].bias[0] += 1
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer)


def test_layout_is_mixed_in() -> None:
    a = nn.Linear(4, 3, bias=False)
    b = nn.Linear(6, 2, bias=False)
    with torch.no_grad():
        b.weight.copy_(a.weight.reshape(2, 6))  # the very same bytes, another shape
    assert StateHasher().digest(a).digest != StateHasher().digest(b).digest


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_flipped_bit_changes_that_tensor_and_the_whole(data: st.DataObject) -> None:
    model, optimizer = _replica(seed=data.draw(st.integers(0, 3)))
    _train(model, optimizer)
    hasher = StateHasher()
    before = hasher.digest(model, optimizer)
    items = named_state(model, optimizer)
    index = data.draw(st.integers(0, len(items) - 1), label="tensor")
    name, tensor = items[index]
    raw = tensor.view(-1).view(torch.uint8) if tensor.dim() else tensor.view(1).view(torch.uint8)
    byte = data.draw(st.integers(0, raw.numel() - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    raw[byte] ^= 1 << bit
    after = hasher.digest(model, optimizer)
    assert after.digest != before.digest
    changed = [n for (n, x), (_, y) in zip(before.tensors, after.tensors) if x != y]
    assert changed == [name]


def test_full_walk_only_when_the_layout_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """While nothing moved, a digest skips the per-tensor walk; any change takes it again."""
    walks = []
    walk = digest_module._state_tensors

    def counted(*args: Any) -> Any:
        walks.append(1)
        return walk(*args)

    monkeypatch.setattr(digest_module, "_state_tensors", counted)
    model, optimizer = _replica()
    _train(model, optimizer)
    hasher = StateHasher()
    hasher.digest(model, optimizer)
    for _ in range(3):
        _train(model, optimizer)
        assert hasher.digest(model, optimizer) == state_digest(model, optimizer)
    assert len(walks) == 2 + 3  # the hasher's first two digests, and each state_digest
    walks.clear()
    optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))], "lr": 0.1})
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer)
    assert len(walks) == 2  # the plan no longer held: walked
    # The new parameter is not the model's and has no state yet: the same tensors and names
    # as before, so that walk planned again, and the next digest skips it.
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer)
    assert len(walks) == 3


def _layout_changes() -> list[tuple[str, Callable[[nn.Module, torch.optim.Optimizer], None]]]:
    def swap_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = optimizer.state[model[0].weight]
        state["exp_avg"] = state["exp_avg"].clone() + 1  # same shape, a new tensor

    def reload(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        saved = optimizer.state_dict()
        saved["state"][0]["exp_avg_sq"] = saved["state"][0]["exp_avg_sq"] * 2
        optimizer.load_state_dict(saved)

    def replace_module(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model[1] = nn.Linear(8, 8)  # a new parameter where there was none

    def rename(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        head = model[2]
        del model[2]
        model.add_module("head", head)  # the same tensors under other names

    def same_storage_other_dtype(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        bias = model[0].bias.requires_grad_(False)
        bias.data = bias.data.view(torch.int32)  # same pointer, shape and stride

    def new_param_group(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        extra = nn.Parameter(torch.arange(16.0).view(4, 4))
        model.add_module("square", nn.Module())
        model.square.weight = extra
        optimizer.add_param_group({"params": [extra]})

    def swap_parameter(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model[2].weight = nn.Parameter(model[2].weight.detach() + 1)  # same name, a new object

    def new_buffer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model[0].register_buffer("scale", torch.ones(3))

    def nested_child(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model[0].add_module("inner", nn.Linear(2, 2))  # deep in the tree, not at its root

    def parameter_removed(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model[2].bias = None  # still registered, as None: no longer a parameter

    return [
        ("swap_parameter", swap_parameter),
        ("new_buffer", new_buffer),
        ("nested_child", nested_child),
        ("parameter_removed", parameter_removed),
        ("swap_state", swap_state),
        ("reload", reload),
        ("replace_module", replace_module),
        ("rename", rename),
        ("dtype", same_storage_other_dtype),
        ("new_param_group", new_param_group),
    ]


@pytest.mark.parametrize(
    ("label", "change"), _layout_changes(), ids=lambda item: item if isinstance(item, str) else ""
)
def test_reused_hasher_follows_every_layout_change(
    label: str, change: Callable[[nn.Module, torch.optim.Optimizer], None]
) -> None:
    model, optimizer = _replica()
    _train(model, optimizer)
    hasher = StateHasher()
    hasher.digest(model, optimizer)
    before = hasher.digest(model, optimizer)  # the layout seen twice: cheap from here on
    change(model, optimizer)
    after = hasher.digest(model, optimizer)
    fresh = state_digest(model, optimizer)
    assert after == fresh and after.tensors == fresh.tensors, label
    assert after.names == fresh.names, label
    assert after != before, label


def test_swapped_buffer_is_never_hashed_stale() -> None:
    """A buffer replaced by another tensor under the same name, after the plan formed."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model(torch.randn(6, 3))  # running statistics away from their initial values
    hasher = StateHasher()
    hasher.digest(model)
    before = hasher.digest(model)  # from the plan
    model[1].running_mean = torch.zeros(4)
    after = hasher.digest(model)
    assert after == state_digest(model) and after.tensors == state_digest(model).tensors
    assert after != before


def test_transposed_in_place_is_never_hashed_stale() -> None:
    """The same parameter object over the same pointer, shape and dtype, other strides."""
    model = nn.Linear(3, 3, bias=False)
    hasher = StateHasher()
    hasher.digest(model)
    hasher.digest(model)
    before = hasher.digest(model)  # from the plan
    weight = model.weight
    weight.data = weight.data.t()  # square: only the strides tell
    after = hasher.digest(model)
    assert after == state_digest(model)
    assert after != before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_digests_like_its_host_copy() -> None:
    model, optimizer = _replica()
    _train(model, optimizer)
    host = state_digest(model, optimizer)
    model.cuda()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.cuda()
    hasher = StateHasher()
    assert hasher.digest(model, optimizer) == host
    with torch.no_grad():
        model[0].bias.add_(1)  # queued on the stream: the digest must wait for it
    assert hasher.digest(model, optimizer) != host


def test_parameter_moved_to_the_next_module_is_never_named_stale() -> None:
    """The same parameter object under the same local name, registered one module further on:
    the registrations flattened over the tree read as before; only each dict's size tells."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    hasher = StateHasher()
    hasher.digest(model)
    before = hasher.digest(model)  # from the plan
    bias = model[0].bias
    del model[0].bias
    model[1].bias = bias
    after = hasher.digest(model)
    fresh = state_digest(model)
    assert "param/1.bias" in after.names and after.names == fresh.names
    assert after == fresh and after != before


def test_param_group_values_are_followed_by_identity_not_equality() -> None:
    """The param groups' kept encoding: a scheduler's new learning rate, an int turned into the
    equal float, -0.0 for 0.0 and a tensor learning rate changed in place are all seen."""
    model, optimizer = _replica()
    _train(model, optimizer)
    hasher = StateHasher()
    hasher.digest(model, optimizer)
    group = optimizer.param_groups[0]
    seen = [hasher.digest(model, optimizer)]
    for value in (0.02, 1, 1.0, 0.0, -0.0):
        group["lr"] = value
        now = hasher.digest(model, optimizer)
        assert now == state_digest(model, optimizer), value
        assert now not in seen, value
        seen.append(now)
    group["lr"] = torch.tensor(0.5)
    before = hasher.digest(model, optimizer)
    group["lr"].fill_(0.25)  # the same tensor object, another value
    after = hasher.digest(model, optimizer)
    assert after == state_digest(model, optimizer) and after != before
    group["extra"] = (1, 2.0)  # a new key
    assert hasher.digest(model, optimizer) == state_digest(model, optimizer) != after
