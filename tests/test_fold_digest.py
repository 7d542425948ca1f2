"""The fold digest (`paramsync.actors.state.fold_digest`, docs/digest.md) on the CPU: it agrees
with the plain-integer reference, sees every single-bit flip in every lane and every swap of two
different elements, ignores strides, storage offsets and views, covers every dtype the wire
carries, and refuses an entry over its word limit. A `cuda` test checks CPU and CUDA agree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync.actors.state.digest import StateHasher, state_digest
from paramsync.actors.state.fold_digest import (
    BASES,
    EXPONENTS,
    FOLD_NAME,
    MAX_WORDS,
    MODULUS,
    FoldLayout,
    entry_header,
    fold_digests,
    fold_words,
    pack_lanes,
    words_of,
)
from paramsync.runtime.protocol.wire import tensor_buffer

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "digest.md").read_text(encoding="utf-8")

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
"""Every dtype the wire carries."""


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (any bit pattern, nan payloads included;
    bool: 0 or 1)."""
    generator = torch.Generator().manual_seed(seed)
    size = torch.empty(shape, dtype=dtype).element_size()
    count = int(torch.Size(shape).numel())
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def reference(name: str, tensor: torch.Tensor) -> bytes:
    """The digest by the definition, in plain Python integers."""
    data = bytes(tensor_buffer(tensor.contiguous()))
    words = words_of(entry_header(name, tensor.shape, tensor.dtype)) + words_of(data)
    return pack_lanes(fold_words(words))


def lanes(digest: bytes) -> list[int]:
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


def test_the_bases_are_distinct_primitive_roots() -> None:
    factors = (2, 3, 7, 11, 31, 151, 331)
    rest = MODULUS - 1
    for q in factors:
        while rest % q == 0:
            rest //= q
    assert rest == 1, "the factors of p - 1 are complete"
    assert len(set(BASES)) == 4
    for base in BASES:
        assert all(pow(base, (MODULUS - 1) // q, MODULUS) != 1 for q in factors)
    assert EXPONENTS == (13, 17, 19, 23)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), shapes, st.integers(0, 2**32 - 1))
def test_the_device_computation_is_the_definition(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> None:
    tensor = random_tensor(dtype, shape, seed)
    other = random_tensor(torch.float32, (3,), seed + 1)
    named = [("a", tensor), ("b.weight", other)]
    assert fold_digests(named) == [reference(n, t) for n, t in named]


def test_entries_spanning_several_rows_and_batches_are_the_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from paramsync.actors.state import fold_digest

    monkeypatch.setattr(fold_digest, "_BATCH_BYTES", 2048)
    monkeypatch.setattr(fold_digest, "_BLOCK_ROWS", 3)
    named = [(f"t{i}", random_tensor(torch.float32, (300 + 257 * i,), i)) for i in range(4)]
    named.append(("odd", random_tensor(torch.uint8, (1001,), 9)))
    expected = [reference(n, t) for n, t in named]
    assert fold_digests(named) == expected
    # The row sums CUDA takes (broadcast products, no integer matrix product), on the CPU.
    tensors = [t for _, t in named]
    layout = FoldLayout([entry_header(n, t.shape, t.dtype) for n, t in named], tensors)
    layout._integer_mm = False
    assert layout.entries(layout.launch(tensors).numpy()) == expected


views = st.sampled_from(["transposed", "sliced", "expanded", "offset", "strided"])


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(DTYPES), views, st.integers(0, 2**32 - 1))
def test_equal_values_in_any_strides_or_views_digest_equal(
    dtype: torch.dtype, how: str, seed: int
) -> None:
    base = random_tensor(dtype, (6, 5), seed)
    if how == "transposed":
        view = base.t()
    elif how == "sliced":
        view = base[1:5, ::2]
    elif how == "expanded":
        view = base[0:1].expand(4, 5)
    elif how == "offset":
        storage = torch.cat((random_tensor(dtype, (7,), seed + 1), base.reshape(-1)))
        view = storage[7:].view(6, 5)
    else:
        view = random_tensor(dtype, (6, 10), seed + 2)[:, ::2]
    dense = view.contiguous().clone()
    assert fold_digests([("x", view)]) == fold_digests([("x", dense)])
    if how == "expanded":  # expanded, then contiguous: its own values
        assert fold_digests([("x", view.contiguous())]) == fold_digests([("x", dense)])


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    st.integers(0, 2**32 - 1),
    st.data(),
)
def test_any_single_bit_flip_changes_every_lane(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, data: st.DataObject
) -> None:
    tensor = random_tensor(dtype, shape, seed)
    raw = tensor.reshape(-1).view(torch.uint8)
    byte = data.draw(st.integers(0, raw.numel() - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = raw.clone()
    flipped[byte] ^= 1 << bit
    before = fold_digests([("p", tensor), ("q", tensor)])
    after = fold_digests([("p", tensor), ("q", flipped.view(dtype).reshape(shape))])
    assert before[0] == after[0]
    assert all(old != new for old, new in zip(lanes(before[1]), lanes(after[1]), strict=True))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(2, 40), st.integers(0, 2**32 - 1), st.data())
def test_a_swap_of_two_different_elements_changes_the_digest(
    dtype: torch.dtype, count: int, seed: int, data: st.DataObject
) -> None:
    tensor = random_tensor(dtype, (count,), seed)
    i = data.draw(st.integers(0, count - 1))
    j = data.draw(st.integers(0, count - 1))
    raw = tensor.view(torch.uint8).reshape(count, -1)
    if i == j or torch.equal(raw[i], raw[j]):
        return  # equal bytes: a swap changes nothing to see
    swapped = tensor.clone()
    swapped[i], swapped[j] = tensor[j].clone(), tensor[i].clone()
    assert fold_digests([("s", tensor)]) != fold_digests([("s", swapped)])


def test_a_swap_of_bytes_across_words_changes_the_digest() -> None:
    # Bytes at different offsets within their words, in many pairs of words.
    for seed in range(20):
        tensor = random_tensor(torch.uint8, (301,), seed)
        for i, j in ((0, 3), (1, 2), (5, 300), (7, 8)):
            if tensor[i] == tensor[j]:
                continue
            swapped = tensor.clone()
            swapped[i], swapped[j] = tensor[j], tensor[i]
            assert fold_digests([("u", tensor)]) != fold_digests([("u", swapped)])


def test_the_header_names_shape_and_dtype() -> None:
    zeros = torch.zeros(4, dtype=torch.int16)
    digests = {
        fold_digests([("w", zeros)])[0],
        fold_digests([("v", zeros)])[0],
        fold_digests([("w", zeros.reshape(2, 2))])[0],
        fold_digests([("w", zeros.view(torch.float16))])[0],
    }
    assert len(digests) == 4


def test_an_entry_over_the_word_limit_is_refused() -> None:
    # Meta tensors: the limit is checked before a byte is read or a table built.
    header = entry_header("big", (2**32,), torch.uint8)
    under = (MAX_WORDS - len(words_of(header))) * 2
    FoldLayout.check([header], [torch.empty(under, dtype=torch.uint8, device="meta")])
    with pytest.raises(ValueError, match="over the fold digest's limit"):
        FoldLayout.check([header], [torch.empty(under + 2, dtype=torch.uint8, device="meta")])
    with pytest.raises(ValueError, match="over the fold digest's limit"):
        FoldLayout([header], [torch.empty(2**32, dtype=torch.uint8, device="meta")])


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_the_hasher_folds_when_told_and_names_its_algorithm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, optimizer = _model()
    monkeypatch.delenv("PARAMSYNC_STATE_DIGEST", raising=False)
    xxh3 = state_digest(model, optimizer)
    assert xxh3.algorithm == "xxh3-128"  # a state entirely on the CPU: XXH3
    hasher = StateHasher(algorithm="fold")
    folded = hasher.digest(model, optimizer)
    assert folded.algorithm == FOLD_NAME
    assert folded.names == xxh3.names
    assert folded != xxh3 and folded.digest != xxh3.digest
    assert folded == hasher.digest(model, optimizer)  # the kept layout: the same digest
    tensors = dict(folded.tensors)
    weight = model[0].weight.detach()
    assert tensors["param/0.weight"] == reference("param/0.weight", weight)
    assert tensors["optim/param_groups"] == dict(xxh3.tensors)["optim/param_groups"]
    monkeypatch.setenv("PARAMSYNC_STATE_DIGEST", "fold")
    assert state_digest(model, optimizer) == folded
    monkeypatch.setenv("PARAMSYNC_STATE_DIGEST", "sha")
    with pytest.raises(ValueError, match="PARAMSYNC_STATE_DIGEST"):
        StateHasher()
    with torch.no_grad():
        model[0].weight[1, 2] += 1.0
    changed = StateHasher(algorithm="fold").digest(model, optimizer)
    assert changed != folded
    assert [n for n, d in changed.tensors if dict(folded.tensors)[n] != d] == ["param/0.weight"]


# --------------------------------------------------------------------------- the document


def _section(heading: str) -> str:
    start = DOC.index(heading)
    end = DOC.find("\n## ", start + len(heading))
    return DOC[start : end if end >= 0 else len(DOC)]


def test_the_document_s_constants_are_the_code_s() -> None:
    text = _section("## 2. The lanes")
    assert re.search(r"p = 2\^31 \u2212 1 = 2147483647", text)
    exponents = tuple(int(k) for k in re.search(r"k = \(([\d, ]+)\)", text)[1].split(","))
    assert exponents == EXPONENTS
    bases = tuple(int(b) for b in re.search(r"bases \(([\d, ]+)\)", text)[1].split(","))
    assert bases == BASES == tuple(pow(7, k, 2**31 - 1) for k in exponents)
    assert f"{MAX_WORDS}" in _section("## 4. Limits")


def test_the_document_s_test_vector_is_rebuilt_from_its_own_text() -> None:
    """The vector's state, its constants and its expected bytes are read from the document; the
    digest is rebuilt by the document's definition in plain integers, then by the code."""
    text = _section("## 8. Test vector")
    p = 2**31 - 1
    exponents = [int(k) for k in re.search(r"k = \(([\d, ]+)\)", DOC)[1].split(",")]
    rows = re.findall(
        r"^\| `([^`]+)` \| `([^`]+)` \| `\[([\d, ]*)\]` \| `([0-9a-f]*)` \|", text, re.M
    )
    expected = dict(re.findall(r"^- `([^`]+)`: `([0-9a-f]{32})`$", text, re.M))
    state = re.search(r"^state digest: `([0-9a-f]{32})`$", text, re.M)[1]
    assert len(rows) >= 3 and len(expected) == len(rows)
    named = []
    for name, dtype, shape, data in rows:
        dims = [int(d) for d in shape.split(",") if d.strip()]
        header = f"{name}|{dims}|torch.{dtype}|".encode()
        raw = bytes.fromhex(data)
        stream = header + (b"\0" if len(header) % 2 else b"") + raw + b"\0" * (len(raw) % 2)
        words = [int.from_bytes(stream[i : i + 2], "little") for i in range(0, len(stream), 2)]
        lanes_ = []
        for k in exponents:
            base = pow(7, k, p)
            lanes_.append(sum(w * pow(base, i, p) for i, w in enumerate(words)) % p)
        digest = b"".join(lane.to_bytes(4, "little") for lane in lanes_)
        assert digest.hex() == expected[name], name
        tensor = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(dims)
        named.append((name, tensor.clone()))
    assert [d.hex() for d in fold_digests(named)] == [expected[n] for n, *_ in rows]
    import xxhash

    packed = b"".join(bytes.fromhex(expected[n]) for n, *_ in rows)
    assert xxhash.xxh3_128_digest(packed).hex() == state


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cpu_and_cuda_give_equal_digests() -> None:
    named = [
        (f"{dtype}", random_tensor(dtype, (33, 17), seed)) for seed, dtype in enumerate(DTYPES)
    ]
    named.append(("big", random_tensor(torch.float32, (3_000_001,), 99)))
    named.append(("view", random_tensor(torch.float64, (40, 30), 7).t()[3:]))
    on_cuda = [(n, t.cuda()) for n, t in named]
    assert fold_digests(on_cuda) == fold_digests(named)
    model, optimizer = _model()
    cpu = StateHasher(algorithm="fold").digest(model, optimizer)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer.load_state_dict(_model()[1].state_dict())
    hasher = StateHasher()  # auto: folds a state on the GPU
    pending = hasher.start(model, optimizer)
    gpu = pending.result()
    assert gpu.algorithm == FOLD_NAME
    assert dict(gpu.tensors)["param/0.weight"] == dict(cpu.tensors)["param/0.weight"]


# --------------------------------------------------------------------------- in a run


async def test_a_run_forced_to_the_fold_reports_it_and_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks with ``state_digest="fold"``: every digest the coordinator compares is a fold
    (the trainer's overlapped check included), and the run commits."""
    import trio

    from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
    from paramsync.actors.train.worker import train_in_process
    from paramsync.runtime.coordinator import commits

    seen: list[str] = []
    original = commits.digest_verdict

    def spy(step: int, reports, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.extend(report.algorithm for report in reports.values())
        return original(step, reports, *args, **kwargs)

    def make_replica(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    async def body(trainer: DistributedTrainer) -> Any:
        generator = torch.Generator().manual_seed(trainer.dist_config.rank)
        for _ in range(3):
            x = torch.randn(4, 4, generator=generator)
            await trainer.train_batch((x, x.sum(1, keepdim=True)))
        await trainer.verified()
        return trainer.run.state_digest()

    monkeypatch.setattr(commits, "digest_verdict", spy)
    with trio.fail_after(60):
        results = await train_in_process(
            2, make_replica, mse, body, options=TrainerOptions(state_digest="fold")
        )
    assert results[0] == results[1] and results[0].algorithm == FOLD_NAME
    assert seen and set(seen) == {FOLD_NAME}
    with pytest.raises(ValueError, match="state_digest"):
        TrainerOptions(state_digest="sha256")  # type: ignore[arg-type]
