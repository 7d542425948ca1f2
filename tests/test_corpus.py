"""Tests for paramsync.actors.demo_job.corpus: the stdlib corpus, the vocabulary, windows and rank
shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from paramsync.actors.demo_job.corpus import (
    CharDataset,
    CharVocab,
    iter_batches,
    load_char_dataset,
    load_corpus,
    source_files,
    stdlib_root,
)
from paramsync.actors.graph.sampler import shard

SMALL = 64 * 1024


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


# --- corpus -----------------------------------------------------------------------------------


def test_stdlib_corpus_is_real_deterministic_and_capped() -> None:
    a = load_corpus(max_bytes=SMALL)
    b = load_corpus(max_bytes=SMALL)
    assert a == b
    assert SMALL - 4 <= len(a.encode()) <= SMALL
    assert "def " in a and "import " in a
    first = source_files()[0]
    assert a.startswith(first.read_text(encoding="utf-8")[:200])
    assert stdlib_root().is_dir()


def test_source_files_are_sorted_and_skip_site_packages(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "b.py": b"b\n",
            "a/z.py": b"az\n",
            "a/b.py": b"ab\n",
            "site-packages/x.py": b"x\n",
            "c.txt": b"c\n",
            "_a.py": b"_a\n",
        },
    )
    names = [p.relative_to(tmp_path).as_posix() for p in source_files(tmp_path)]
    assert names == ["_a.py", "a/b.py", "a/z.py", "b.py"]
    assert all("site-packages" not in str(p) for p in source_files())


def test_load_corpus_joins_files_and_skips_non_utf8(tmp_path: Path) -> None:
    make_tree(tmp_path, {"a.py": b"alpha", "b.py": b"\xff\xfe bad", "c.py": b"gamma\n"})
    assert load_corpus(tmp_path) == "alpha\ngamma\n"
    assert load_corpus(tmp_path, max_bytes=3) == "alp"


def test_cap_inside_a_multibyte_character_drops_it(tmp_path: Path) -> None:
    make_tree(tmp_path, {"a.py": "ab\u00e9cd\n".encode()})
    assert load_corpus(tmp_path, max_bytes=3) == "ab"


@pytest.mark.parametrize(
    "files", [{}, {"a.txt": b"text"}, {"a.py": b""}, {"a.py": b"\xff"}], ids=str
)
def test_empty_corpus_is_an_error(tmp_path: Path, files: dict[str, bytes]) -> None:
    make_tree(tmp_path, files)
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path)


def test_bad_corpus_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(max_bytes=0)


# --- vocabulary -------------------------------------------------------------------------------


def test_vocab_round_trip_on_the_corpus() -> None:
    text = load_corpus(max_bytes=SMALL)
    vocab = CharVocab.from_text(text)
    assert len(vocab) == len(set(text)) + 1
    assert vocab.decode(vocab.encode(text)) == text
    assert vocab.decode(vocab.encode_tensor(text)) == text
    assert vocab.encode_tensor("ab").dtype == torch.int64


@settings(max_examples=100, deadline=None)
@given(text=st.text(min_size=1, max_size=200), other=st.text(max_size=50))
def test_vocab_round_trip_property(text: str, other: str) -> None:
    vocab = CharVocab.from_text(text)
    assert vocab.decode(vocab.encode(text)) == text
    ids = vocab.encode(other)
    assert all(0 <= i < len(vocab) for i in ids)
    assert [i == vocab.unk_id for i in ids] == [c not in text for c in other]


def test_unknown_chars_share_one_id() -> None:
    vocab = CharVocab.from_text("abc")
    assert vocab.encode("xaz") == [0, 1, 0]
    assert vocab.decode([0, 1]) == CharVocab.UNK + "a"


def test_vocab_max_size_keeps_most_frequent() -> None:
    vocab = CharVocab.from_text("aaabbbbcd", max_size=3)
    assert vocab.chars == ("a", "b")
    assert vocab.encode("abcd") == [1, 2, 0, 0]


def test_vocab_equality_and_rebuild_from_chars() -> None:
    vocab = CharVocab.from_text("hello")
    assert CharVocab(vocab.chars) == vocab
    assert CharVocab(list(vocab.chars)).encode("hello") == vocab.encode("hello")


@pytest.mark.parametrize(
    "build",
    [
        lambda: CharVocab.from_text(""),
        lambda: CharVocab(()),
        lambda: CharVocab(("a", "a")),
        lambda: CharVocab(("ab",)),
        lambda: CharVocab.from_text("abc", max_size=1),
        lambda: CharVocab.from_text("abc").decode([4]),
        lambda: CharVocab.from_text("abc").decode([-1]),
    ],
)
def test_vocab_errors(build) -> None:
    with pytest.raises(ValueError):
        build()


# --- dataset ----------------------------------------------------------------------------------


def test_dataset_windows_are_shifted_pairs() -> None:
    tokens = torch.arange(20)
    ds = CharDataset(tokens, context=4)
    assert len(ds) == 4  # starts 0, 4, 8, 12; 16 would need token 20
    x, y = ds[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert x.dtype == torch.int64
    assert ds[-1][0].tolist() == [12, 13, 14, 15]
    with pytest.raises(IndexError):
        ds[4]
    overlapping = CharDataset(tokens, context=4, stride=1)
    assert len(overlapping) == 16
    assert overlapping[15][1].tolist() == [16, 17, 18, 19]


def test_dataset_batch_matches_items_and_iter_batches() -> None:
    ds = CharDataset(torch.arange(100) % 7, context=8, stride=3)
    x, y = ds.batch([5, 0, 9])
    assert x.shape == y.shape == (3, 8)
    for row, i in enumerate([5, 0, 9]):
        assert torch.equal(x[row], ds[i][0]) and torch.equal(y[row], ds[i][1])
    batches = list(iter_batches(ds, list(range(10)), batch_size=4))
    assert len(batches) == 2
    assert torch.equal(batches[1][0], ds.batch([4, 5, 6, 7])[0])


@pytest.mark.parametrize(
    "build",
    [
        lambda: CharDataset(torch.arange(4), context=4),
        lambda: CharDataset(torch.arange(10), context=0),
        lambda: CharDataset(torch.arange(10), context=2, stride=0),
        lambda: CharDataset(torch.zeros(2, 5), context=2),
        lambda: CharDataset(torch.arange(10), context=2).batch([]),
        lambda: list(iter_batches(CharDataset(torch.arange(10), context=2), [0], 0)),
    ],
)
def test_dataset_errors(build) -> None:
    with pytest.raises(ValueError):
        build()


def test_load_char_dataset_on_the_stdlib() -> None:
    vocab, ds = load_char_dataset(32, max_bytes=SMALL)
    assert len(ds) > 1000
    x, y = ds[10]
    assert vocab.decode(x)[1:] == vocab.decode(y)[:-1]
    assert 60 < len(vocab) < 200


# --- shards -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "world"), [(100, 4), (103, 4), (5, 5), (3, 4), (0, 2), (17, 1)])
def test_shards_are_disjoint_equal_and_cover(n: int, world: int) -> None:
    shards = [shard(n, r, world, seed=3, epoch=1) for r in range(world)]
    assert all(len(s) == n // world for s in shards)
    union = [i for s in shards for i in s]
    assert len(set(union)) == len(union)
    assert set(union) <= set(range(n))
    assert len(union) == n - n % world


def test_shards_are_deterministic_and_change_with_epoch_and_seed() -> None:
    assert shard(1000, 1, 4, seed=0, epoch=0) == shard(1000, 1, 4, seed=0, epoch=0)
    assert shard(1000, 1, 4, seed=0, epoch=0) != shard(1000, 1, 4, seed=0, epoch=1)
    assert shard(1000, 1, 4, seed=0, epoch=0) != shard(1000, 1, 4, seed=1, epoch=0)


@pytest.mark.parametrize(("n", "world", "epoch"), [(50, 4, 0), (51, 4, 2), (8, 3, 1)])
def test_shard_matches_torch_distributed_sampler(n: int, world: int, epoch: int) -> None:
    data = list(range(n))
    for rank in range(world):
        sampler = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=True, seed=9, drop_last=True
        )
        sampler.set_epoch(epoch)
        assert shard(n, rank, world, seed=9, epoch=epoch) == list(sampler)


@pytest.mark.parametrize(
    "args",
    [(10, 4, 4, 0, 0), (10, -1, 4, 0, 0), (10, 0, 0, 0, 0), (-1, 0, 1, 0, 0), (10, 0, 1, 0, -1)],
)
def test_shard_errors(args: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        shard(*args)
    with pytest.raises(ValueError, match="rank"):
        shard(10, True, 2, 0, 0)  # type: ignore[arg-type]
