"""actors.digest: the state digests behind the C-DDP-001 check.

* A `StateHasher` reused step after step (its cached byte views) gives exactly the digest a
  fresh hash of the same state gives, through optimizer steps, swapped and resized storage,
  optimizer state appearing and disappearing, non-contiguous tensors, scalar optimizer state
  and bfloat16.
* Any single flipped bit changes the whole digest and exactly that tensor's digest
  (hypothesis); names, shapes and dtypes are mixed in, so equal bytes in another layout differ.
"""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from actors.digest import StateHasher, named_state, state_digest


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
    assert [name for name, _ in digest.tensors] == [
        name for name, _ in named_state(model, optimizer)
    ]
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
    assert all(name.startswith("param/") for name, _ in empty.tensors)
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
