"""A real, local text corpus for the demo LM: CPython's standard-library sources.

Every machine with Python has these files, so training needs no download. The corpus is the
``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded) read in sorted
order up to a byte cap, so every rank that runs the same Python builds the same text.
`CharVocab` maps characters to ids and `CharDataset` cuts the token stream into (input, target)
windows; `paramsync.actors.graph.sampler.shard` deals their indices out to ranks.
"""

from __future__ import annotations

import operator
import os
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "CharDataset",
    "CharVocab",
    "iter_batches",
    "iter_source_files",
    "load_char_dataset",
    "load_corpus",
    "source_files",
    "stdlib_root",
]

DEFAULT_MAX_BYTES = 2 * 1024 * 1024
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """Directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def iter_source_files(root: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Yield the ``*.py`` files under ``root`` (default: the stdlib) in a fixed order.

    Each directory's entries are visited sorted by name, a subdirectory's files in place of
    its name (depth first), so ``load_corpus`` can stop early without listing the whole tree.
    ``site-packages``/``dist-packages`` are skipped: they differ between machines.
    """
    base = stdlib_root() if root is None else Path(root)
    if not base.is_dir():
        raise ValueError(f"corpus root {str(base)!r} is not a directory")
    yield from _walk(base)


def _walk(directory: Path) -> Iterator[Path]:
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIP_DIRS:
                yield from _walk(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """All of `iter_source_files` as a list."""
    return list(iter_source_files(root))


def load_corpus(
    root: str | os.PathLike[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> str:
    """The first ``max_bytes`` bytes of the concatenated sources (files joined by newlines).

    Files that are not UTF-8 are skipped (the stdlib's tests hold a few on purpose). Raises
    ``ValueError`` when there is no text.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    chunks: list[bytes] = []
    total = 0
    for path in iter_source_files(root):
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not data:
            continue
        if not data.endswith(b"\n"):
            data += b"\n"
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    # A cut inside a multi-byte character drops its partial bytes.
    text = b"".join(chunks)[:max_bytes].decode("utf-8", errors="ignore")
    if not text:
        where = stdlib_root() if root is None else root
        raise ValueError(f"corpus under {str(where)!r} is empty: no UTF-8 *.py text found")
    return text


@dataclass(frozen=True)
class CharVocab:
    """Character vocabulary: id 0 is the unknown character, ids 1.. are ``chars`` in order.

    Text outside the vocabulary encodes to `unk_id`, which decodes to `UNK`.
    """

    chars: tuple[str, ...]

    UNK = "\ufffd"
    unk_id = 0

    def __post_init__(self) -> None:
        chars = tuple(self.chars)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"vocabulary entries must be single characters, got {bad[0]!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("vocabulary has duplicate characters")
        if not chars:
            raise ValueError("vocabulary is empty")
        object.__setattr__(self, "chars", chars)
        object.__setattr__(self, "_ids", {c: i + 1 for i, c in enumerate(chars)})

    @classmethod
    def from_text(cls, text: str, max_size: int | None = None) -> CharVocab:
        """The sorted distinct characters of ``text``; with ``max_size``, only the
        ``max_size - 1`` most frequent ones (ties by code point), the rest become unknown."""
        if not text:
            raise ValueError("cannot build a vocabulary from empty text")
        if max_size is None:
            return cls(tuple(sorted(set(text))))
        if max_size < 2:
            raise ValueError(f"max_size must be at least 2 (unknown + one char), got {max_size}")
        counts = Counter(text)
        ranked = sorted(counts, key=lambda c: (-counts[c], c))[: max_size - 1]
        return cls(tuple(sorted(ranked)))

    def __len__(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> list[int]:
        """Character ids of ``text``; unknown characters map to `unk_id`."""
        get = self._ids.get  # type: ignore[attr-defined]
        return [get(c, 0) for c in text]

    def encode_tensor(self, text: str) -> torch.Tensor:
        """`encode` as a 1-D int64 tensor."""
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of ``ids``; raises ``ValueError`` for an id outside the vocabulary."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        out = []
        size = len(self)
        for i in ids:
            if not 0 <= i < size:
                raise ValueError(f"id {i} is outside the vocabulary (size {size})")
            out.append(self.UNK if i == 0 else self.chars[i - 1])
        return "".join(out)


class CharDataset:
    """(input, target) windows of ``context`` tokens cut from one token stream.

    Window ``i`` starts at ``i * stride`` (``stride`` defaults to ``context``: windows do not
    overlap); its target is the same window shifted one token on.
    """

    def __init__(self, tokens: torch.Tensor, context: int, stride: int | None = None) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be a positive int, got {context!r}")
        stride = context if stride is None else stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        if tokens.numel() < context + 1:
            raise ValueError(
                f"{tokens.numel()} tokens are too few for one window of context {context} "
                f"(need {context + 1})"
            )
        self.tokens = tokens.to(torch.int64)
        self.context = context
        self.stride = stride
        self._len = (tokens.numel() - context - 1) // stride + 1
        self._offsets = torch.arange(context)

    @classmethod
    def from_text(
        cls, text: str, vocab: CharVocab, context: int, stride: int | None = None
    ) -> CharDataset:
        """Encode ``text`` with ``vocab`` and cut it into windows."""
        return cls(vocab.encode_tensor(text), context, stride)

    def __len__(self) -> int:
        return self._len

    def _start(self, index: int) -> int:
        index = operator.index(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} is out of range for {self._len} windows")
        return index * self.stride

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._start(index)
        x = self.tokens[start : start + self.context]
        y = self.tokens[start + 1 : start + self.context + 1]
        return x, y

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack windows ``indices`` into (len(indices), context) inputs and targets."""
        if len(indices) == 0:
            raise ValueError("batch needs at least one index")
        starts = torch.tensor([self._start(i) for i in indices], dtype=torch.int64)
        pos = starts[:, None] + self._offsets
        return self.tokens[pos], self.tokens[pos + 1]


def iter_batches(
    dataset: CharDataset, indices: Sequence[int], batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive full batches of ``indices`` (a trailing partial batch is dropped)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for i in range(0, len(indices) - batch_size + 1, batch_size):
        yield dataset.batch(indices[i : i + batch_size])


def load_char_dataset(
    context: int,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    root: str | os.PathLike[str] | None = None,
    stride: int | None = None,
) -> tuple[CharVocab, CharDataset]:
    """Load the corpus, build its vocabulary and cut it into windows, in one call."""
    text = load_corpus(root, max_bytes)
    vocab = CharVocab.from_text(text)
    return vocab, CharDataset.from_text(text, vocab, context, stride)
