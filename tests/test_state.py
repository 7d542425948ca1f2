"""paramsync.actors.state.training_state: capturing and restoring one worker's whole training state.

* Round trip (hypothesis): capture replica A after k steps, restore into replica B (other
  init, its own optimizer, possibly already stepped), then B's state digest equals A's, and
  training both on the same batches keeps every parameter, buffer and optimizer-state tensor
  bitwise identical, over SGD (with and without momentum), Adam and AdamW, float32, bfloat16
  and float16, with and without BatchNorm buffers, tied weights and two param groups. The
  models use dropout, so the continued runs also prove the RNG state was restored.
* Manifests travel through plain CBOR and rebuild an equivalent state from `allocate`d tensors.
* `restore_state` refuses mismatches with a message naming the problem and changes nothing.
"""

from __future__ import annotations

import io
import random
from typing import Any

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from paramsync.actors.state.digest import state_digest
from paramsync.actors.state.training_state import (
    STATE_FORMAT,
    StateMismatch,
    TrainingState,
    allocate,
    capture_state,
    manifest,
    restore_state,
)

OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Tiny(nn.Module):
    """Linear, optional BatchNorm, tanh, dropout, linear; the output layer can share the input
    layer's weight (tied), which `named_parameters` then lists once."""

    def __init__(self, *, buffers: bool = True, tied: bool = False, width: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.norm: nn.Module = nn.BatchNorm1d(width) if buffers else nn.Identity()
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(width, 4)
        if tied:
            assert width == 4
            self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.norm(self.inp(x)))))


def make_replica(
    seed: int,
    kind: str = "adam",
    dtype: torch.dtype = torch.float32,
    *,
    buffers: bool = True,
    tied: bool = False,
    two_groups: bool = False,
    width: int = 4,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model initialized from ``seed`` (without disturbing the global RNG) and its optimizer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Tiny(buffers=buffers, tied=tied, width=width).to(dtype)
    params = list(model.parameters())
    groups: list[dict[str, Any]] = (
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]
        if two_groups
        else [{"params": params}]
    )
    if kind == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.05)
    elif kind == "sgd-momentum":
        optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    elif kind == "adam":
        optimizer = torch.optim.Adam(groups, lr=0.01, eps=1e-3)  # 1e-8 is 0 in float16
    elif kind == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=0.01, betas=(0.8, 0.95), eps=1e-3, amsgrad=True)
    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    return model, optimizer


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a pure function of the step, independent of the global RNG."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(6, 4, generator=generator).to(dtype)
    return x, torch.randn(6, 4, generator=generator)


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dtype: torch.dtype
) -> None:
    model.train()
    for step in steps:
        x, target = batch(step, dtype)
        optimizer.zero_grad()
        (model(x).float() - target).pow(2).mean().backward()
        optimizer.step()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs and signed zeros included), not numeric equality."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
        )
    )


def assert_identical(
    a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]
) -> None:
    """Bitwise-equal parameters, buffers, optimizer state and param groups."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    named_a = list(model_a.named_parameters()) + list(model_a.named_buffers())
    named_b = list(model_b.named_parameters()) + list(model_b.named_buffers())
    assert [n for n, _ in named_a] == [n for n, _ in named_b]
    for (name, ta), (_, tb) in zip(named_a, named_b):
        assert same_bits(ta, tb), name
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for index, values in sd_a["state"].items():
        assert values.keys() == sd_b["state"][index].keys(), index
        for key, value in values.items():
            other = sd_b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert same_bits(value, other), (index, key)
            else:
                assert value == other, (index, key)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(OPTIMIZERS),
    steps=st.integers(0, 3),
    dtype=st.sampled_from(DTYPES),
    buffers=st.booleans(),
    tied=st.booleans(),
    two_groups=st.booleans(),
    b_steps=st.integers(0, 2),
)
def test_round_trip_continues_bitwise(
    kind: str,
    steps: int,
    dtype: torch.dtype,
    buffers: bool,
    tied: bool,
    two_groups: bool,
    b_steps: int,
) -> None:
    options = {"buffers": buffers, "tied": tied, "two_groups": two_groups}
    a = make_replica(1, kind, dtype, **options)
    b = make_replica(2, kind, dtype, **options)
    train(*b, range(50, 50 + b_steps), dtype)  # B's optimizer may hold state of its own
    train(*a, range(steps), dtype)
    digest_a = state_digest(*a)
    state = capture_state(*a, steps, extra={"run": "t"})
    snapshot = [(name, tensor.clone()) for name, tensor in state.tensors]

    more = range(steps, steps + 3)
    train(*a, more, dtype)  # the global RNG continues from where capture saw it
    restore_state(*b, state)  # ... and restore winds it back there for B
    assert state_digest(*b).digest == digest_a.digest
    assert state.step == steps
    train(*b, more, dtype)
    assert_identical(a, b)
    for (name, tensor), (_, before) in zip(state.tensors, snapshot):
        assert same_bits(tensor, before), f"training after restore changed the state's {name}"


def test_names_and_order() -> None:
    model, optimizer = make_replica(3, "adam", tied=True)
    train(model, optimizer, range(1), torch.float32)
    state = capture_state(model, optimizer, 1)
    names = [name for name, _ in state.tensors]
    expected = [
        "param.inp.weight",
        "param.inp.bias",
        "param.norm.weight",
        "param.norm.bias",
        "param.out.bias",  # out.weight is inp.weight: listed once
        "buffer.norm.running_mean",
        "buffer.norm.running_var",
        "buffer.norm.num_batches_tracked",
    ]
    for index in range(5):
        expected += [f"optim.{index}.exp_avg", f"optim.{index}.exp_avg_sq", f"optim.{index}.step"]
    expected.append("rng.torch")
    if torch.cuda.is_available():
        expected += [f"rng.cuda.{i}" for i in range(torch.cuda.device_count())]
    assert names == expected
    assert state.meta["optimizer"]["class"] == "torch.optim.adam.Adam"
    assert state.meta["optimizer"]["param_groups"][0]["params"] == [0, 1, 2, 3, 4]
    assert state.meta["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.999]
    assert state.meta["optimizer"]["state"] == {str(i): {} for i in range(5)}
    assert dict(state.tensors)["buffer.norm.num_batches_tracked"].dtype == torch.int64


def test_capture_copies() -> None:
    """Snapshot tensors are contiguous CPU copies sharing no memory with the model or each
    other, so training on does not change them."""
    model, optimizer = make_replica(4, "sgd-momentum")
    train(model, optimizer, range(2), torch.float32)
    state = capture_state(model, optimizer, 2)
    pointers = [tensor.untyped_storage().data_ptr() for _, tensor in state.tensors]
    assert len(set(pointers)) == len(pointers)
    for _, tensor in state.tensors:
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad
    before = [tensor.clone() for _, tensor in state.tensors]
    train(model, optimizer, range(2, 4), torch.float32)
    assert all(torch.equal(t, b) for (_, t), b in zip(state.tensors, before))
    assert state.nbytes == sum(t.numel() * t.element_size() for t in before)


def test_empty_optimizer_state_round_trip() -> None:
    """Step 0 (no optimizer state yet) restored into a stepped optimizer empties its state."""
    a = make_replica(5, "adamw")
    b = make_replica(6, "adamw")
    train(*b, range(2), torch.float32)
    state = capture_state(*a, 0)
    assert not any(name.startswith("optim.") for name, _ in state.tensors)
    restore_state(*b, state)
    assert b[1].state_dict()["state"] == {}
    assert state_digest(*b) == state_digest(*a)


def test_manifest_through_cbor() -> None:
    """The manifest survives plain CBOR; `allocate` plus `from_manifest` rebuild the state."""
    a = make_replica(7, "adam", torch.bfloat16)
    train(*a, range(2), torch.bfloat16)
    extra = {"note": "resume", "blob": b"\x00\xff", "pair": (1, 2.5), "nested": {"x": [None]}}
    state = capture_state(*a, 2, extra=extra)
    assert state.meta["extra"] == {**extra, "pair": [1, 2.5]}
    described = manifest(state)
    assert described["format"] == STATE_FORMAT and described["step"] == 2
    decoded = cbor2.loads(cbor2.dumps(described))
    assert decoded == described

    received = allocate(decoded)
    assert [(n, list(t.shape), t.dtype) for n, t in received] == [
        (n, list(t.shape), t.dtype) for n, t in state.tensors
    ]
    for (_, into), (_, source) in zip(received, state.tensors):
        into.copy_(source)  # what recv_into does over the network
    rebuilt = TrainingState.from_manifest(decoded, received)
    assert rebuilt.step == 2 and rebuilt.meta == state.meta

    b = make_replica(8, "adam", torch.bfloat16)
    restore_state(*b, rebuilt)
    assert state_digest(*b) == state_digest(*a)


def test_manifest_validation() -> None:
    state = capture_state(*make_replica(9, "sgd"), 0)
    good = manifest(state)
    with pytest.raises(ValueError, match="format"):
        allocate({**good, "format": 99})
    with pytest.raises(ValueError, match="step"):
        allocate({**good, "step": -1})
    first = good["tensors"][0][0]
    for bad, message in [
        ([first, [2, -1], "float32"], "bad shape"),
        ([first, [2], "complex64"], "unsupported dtype"),
        ([first, [2]], r"\[name, shape, dtype\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            allocate({**good, "tensors": [bad]})
    with pytest.raises(ValueError, match="repeated"):
        allocate({**good, "tensors": [good["tensors"][0]] * 2})
    with pytest.raises(ValueError, match="more than 16"):
        allocate(good, max_bytes=16)
    assert len(allocate(good, max_bytes=state.nbytes)) == len(state.tensors)

    tensors = allocate(good)
    with pytest.raises(ValueError, match="manifest lists"):
        TrainingState.from_manifest(good, tensors[:-1])
    swapped = [tensors[1], tensors[0], *tensors[2:]]
    with pytest.raises(ValueError, match=f"expected tensor '{first}'"):
        TrainingState.from_manifest(good, swapped)
    wrong = [(tensors[0][0], torch.empty(3, 3, dtype=torch.float64)), *tensors[1:]]
    with pytest.raises(ValueError, match=f"tensor '{first}': manifest says"):
        TrainingState.from_manifest(good, wrong)


def test_extra_must_be_cborable() -> None:
    model, optimizer = make_replica(10, "sgd")
    with pytest.raises(TypeError, match=r"extra\['when'\]: object is not CBOR-able"):
        capture_state(model, optimizer, 0, extra={"when": object()})
    with pytest.raises(TypeError, match="dict key 1 is not a str"):
        capture_state(model, optimizer, 0, extra={"m": {1: 2}})
    with pytest.raises(TypeError, match="does not fit 64 bits"):
        capture_state(model, optimizer, 0, extra={"big": [-(2**64) - 1]})
    with pytest.raises(ValueError, match="step"):
        capture_state(model, optimizer, -1)
    # The extremes that still fit decode without bignum tags, which paramsync.runtime.protocol.wire
    # refuses.
    edge = manifest(capture_state(model, optimizer, 0, extra={"big": [2**64 - 1, -(2**64)]}))

    def refuse(_decoder: Any, value: Any) -> Any:
        raise AssertionError(f"semantic tag decoded: {value!r}")

    decoder = cbor2.CBORDecoder(
        io.BytesIO(cbor2.dumps(edge)), semantic_decoders={2: refuse, 3: refuse}
    )
    assert decoder.decode() == edge


def _fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Everything a failed restore must leave alone."""
    return (
        state_digest(model, optimizer).digest,
        [t.clone() for t in model.buffers()],
        repr(optimizer.state_dict()["param_groups"]),
        torch.get_rng_state(),
        random.getstate(),
    )


def _assert_same(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert before[0] == after[0]
    assert all(torch.equal(x, y) for x, y in zip(before[1], after[1]))
    assert before[2] == after[2]
    assert torch.equal(before[3], after[3])
    assert before[4] == after[4]


def _two_group_adam(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return make_replica(seed, "adam", two_groups=True)


def _float64_adam(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return make_replica(seed, "adam", torch.float64)


@pytest.mark.parametrize(
    ("make_target", "message"),
    [
        (lambda s: make_replica(s, "adam", width=5), r"'param\.inp\.weight': shape \[4, 4\]"),
        (_float64_adam, r"'param\.inp\.weight': dtype torch\.float32 in the state"),
        (lambda s: make_replica(s, "adam", buffers=False), r"unexpected tensor 'param\.norm\."),
        (lambda s: make_replica(s, "sgd"), "optimizer class: 'torch.optim.adam.Adam'"),
        (_two_group_adam, "number of optimizer param groups: 1 in the state, 2"),
        (lambda s: make_replica(s, "adam", tied=True), r"unexpected tensor 'param\.out\.weight'"),
    ],
    ids=["shape", "dtype", "extra", "optimizer-class", "param-groups", "tied-target"],
)
def test_restore_refuses_mismatch(make_target: Any, message: str) -> None:
    source = make_replica(11, "adam")
    train(*source, range(2), torch.float32)
    state = capture_state(*source, 2)
    target = make_target(12)
    train(*target, range(1), next(target[0].parameters()).dtype)
    random.random()  # the RNGs must also stay where they are: move them, then re-read
    torch.rand(1)
    before = _fingerprint(*target)
    with pytest.raises(StateMismatch, match=message):
        restore_state(*target, state)
    _assert_same(before, _fingerprint(*target))


def test_restore_refuses_missing_tensor() -> None:
    source = make_replica(13, "sgd", buffers=False)
    state = capture_state(*source, 0)
    target = make_replica(14, "sgd", buffers=True)
    with pytest.raises(StateMismatch, match=r"'param\.norm\.weight' \(model\) is missing"):
        restore_state(*target, state)
    own = capture_state(*target, 0)
    own.tensors = [(n, t) for n, t in own.tensors if n != "rng.torch"]
    with pytest.raises(StateMismatch, match=r"'rng\.torch' .* is missing"):
        restore_state(*target, own)
    restore_state(*target, own, restore_rng=False)  # without RNGs the rest fits


def test_restore_refuses_bad_optimizer_state() -> None:
    source = make_replica(15, "adam")
    train(*source, range(1), torch.float32)
    state = capture_state(*source, 1)
    target = make_replica(16, "adam")
    renamed = [("optim.99.exp_avg" if n == "optim.0.exp_avg" else n, t) for n, t in state.tensors]
    with pytest.raises(StateMismatch, match=r"'optim\.99\.exp_avg' names no parameter"):
        restore_state(*target, TrainingState(1, renamed, state.meta))
    with pytest.raises(StateMismatch, match="no optimizer given"):
        restore_state(target[0], None, state)
    doubled = [*state.tensors, state.tensors[0]]
    with pytest.raises(StateMismatch, match="appears twice"):
        restore_state(*target, TrainingState(1, doubled, state.meta))


def test_rng_restored_and_optional() -> None:
    model, optimizer = make_replica(17, "sgd")
    state = capture_state(model, optimizer, 0)
    first = (torch.rand(4), random.random())
    restore_state(model, optimizer, state)
    second = (torch.rand(4), random.random())
    assert torch.equal(first[0], second[0]) and first[1] == second[1]

    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    foreign = TrainingState(
        0, [*state.tensors, ("rng.cuda.7", torch.zeros(16, dtype=torch.uint8))], state.meta
    )
    restore_state(model, optimizer, foreign, restore_rng=False)
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
    if not torch.cuda.is_available():
        with pytest.raises(StateMismatch, match=r"unexpected tensor 'rng\.cuda\.7'"):
            restore_state(model, optimizer, foreign)


def test_without_optimizer() -> None:
    a, _ = make_replica(18, "sgd")
    b, _ = make_replica(19, "sgd")
    state = capture_state(a, None, 5)
    assert state.meta["optimizer"] is None
    restore_state(b, None, state)
    assert state_digest(b) == state_digest(a)
    with pytest.raises(StateMismatch, match="no optimizer state"):
        restore_state(*make_replica(20, "sgd"), state)


class CountingSGD(torch.optim.Optimizer):
    """Plain SGD that also keeps a Python-int counter and a tensor per parameter, to exercise
    non-tensor optimizer state."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                state["last"] = p.grad.clone()
                p.add_(p.grad, alpha=-group["lr"] / state["count"])


def test_non_tensor_optimizer_state() -> None:
    def replica(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, _ = make_replica(seed, "sgd")
        return model, CountingSGD(model.parameters(), lr=0.1)

    a, b = replica(21), replica(22)
    train(*a, range(3), torch.float32)
    state = capture_state(*a, 3)
    assert state.meta["optimizer"]["state"]["0"] == {"count": 3}
    assert "optim.0.last" in dict(state.tensors)
    decoded = cbor2.loads(cbor2.dumps(manifest(state)))
    rebuilt = TrainingState.from_manifest(decoded, state.tensors)
    restore_state(*b, rebuilt)
    assert state_digest(*b) == state_digest(*a)
    train(*a, range(3, 5), torch.float32)
    restore_state(*b, rebuilt)
    train(*b, range(3, 5), torch.float32)
    assert_identical(a, b)
