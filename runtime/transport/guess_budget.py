"""What failed proofs of the secret cost their source: a budget per source and a global one
(sans-I/O: fed the time, it never reads a clock).

A dialer that does not know the secret can still guess it: each handshake tests one guess
(docs/protocol.md section 5.1), and a human secret falls to a dictionary in a few hundred guesses.
`GuessBudget` makes each failed proof cost its source time, not the run:

* every source (`paramsync.runtime.transport.admission.source_key`: an IPv4 address, an IPv6
  /64) may fail ``free_failures`` proofs; each failure beyond those closes the source for a
  back-off that doubles, from ``first_backoff`` to at most ``max_backoff`` seconds. A closed
  source's connections are refused at once, before any handshake work (no key exchange, no
  scrypt). A source with no failure for ``forget_after`` seconds is forgotten (its budget whole
  again): a worker restarted after a typo in its secret is not punished for ever;
* all sources together have ``global_burst`` failures, refilled at ``global_per_second``: once
  that is spent, a source that has failed before is refused until it refills, and a source's
  first failure closes it at once (no free failures), so many sources together guess at about
  ``global_per_second`` plus one guess per fresh source.

A source that has never failed a proof is never refused by the budget: a legitimate worker is
admitted whatever a guesser elsewhere does (its handshakes still share the admission gate's
slots, `paramsync.runtime.transport.admission`). A success does not restore a source's
budget: a guesser sharing a worker's address would otherwise have it reset by the worker.

What one source can reach with the defaults (4 free failures, back-off 1 s doubling to 300 s):
4 guesses at once, 13 in the first 4.3 minutes, then one every 5 minutes (12 an hour).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GuessLimits", "GuessBudget", "Throttled"]


@dataclass(frozen=True)
class GuessLimits:
    """How many failed proofs a listener grants, per source and in all."""

    free_failures: int = 4
    """Failed proofs a source may make before it backs off."""
    first_backoff: float = 1.0
    """Seconds a source is closed after its first failure beyond the free ones; doubles with
    each further failure."""
    max_backoff: float = 300.0
    """The longest back-off, in seconds."""
    forget_after: float = 600.0
    """A source with no failure for this long (after its back-off) is forgotten."""
    global_burst: int = 32
    """Failed proofs all sources together may make at once."""
    global_per_second: float = 0.2
    """The rate at which the global budget refills (failures a second)."""
    max_sources: int = 65536
    """Most sources remembered; beyond that the longest-quiet ones are forgotten first."""

    def __post_init__(self) -> None:
        if self.free_failures < 0 or self.global_burst < 1 or self.max_sources < 1:
            raise ValueError(
                "free_failures must be >= 0, global_burst and max_sources >= 1: got "
                f"{self.free_failures}, {self.global_burst}, {self.max_sources}"
            )
        for name in ("first_backoff", "max_backoff", "forget_after", "global_per_second"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_backoff < self.first_backoff:
            raise ValueError(
                f"max_backoff ({self.max_backoff}) is shorter than first_backoff "
                f"({self.first_backoff})"
            )

    def backoff(self, failures: int) -> float:
        """Seconds a source is closed after its ``failures``-th failed proof (0: none)."""
        over = failures - self.free_failures
        if over <= 0:
            return 0.0
        return min(self.max_backoff, self.first_backoff * 2.0 ** min(over - 1, 64))


@dataclass(frozen=True)
class Throttled:
    """Why a source is refused now: ``scope`` is ``"source"`` (its own back-off) or
    ``"global"`` (the global budget is spent); ``seconds``: how long that lasts at least."""

    scope: str
    seconds: float
    failures: int

    def reason(self, source: str) -> str:
        """The refusal's words, naming the source."""
        if self.scope == "source":
            return (
                f"{self.failures} failed authentications from {source}: its handshakes are "
                f"refused for {self.seconds:.1f} s more"
            )
        return (
            f"{source} failed {self.failures} authentications and the listener's budget of "
            f"failed authentications is spent: refused for {self.seconds:.1f} s"
        )


class _Source:
    __slots__ = ("closed_until", "failures", "last")

    def __init__(self) -> None:
        self.failures = 0
        self.last = 0.0
        self.closed_until = 0.0


class GuessBudget:
    """The failed-proof budgets of one listener (see the module doc). Feed it the time."""

    def __init__(self, limits: GuessLimits | None = None) -> None:
        self.limits = limits or GuessLimits()
        self._sources: dict[str, _Source] = {}
        """By source, least recently failed first."""
        self._tokens = float(self.limits.global_burst)
        self._at: float | None = None
        self.failures = 0
        """Failed proofs counted, all sources."""

    def tokens(self, now: float) -> float:
        """What is left of the global budget at ``now``."""
        if self._at is None:
            return self._tokens
        refill = (now - self._at) * self.limits.global_per_second
        return min(float(self.limits.global_burst), self._tokens + max(0.0, refill))

    def failures_of(self, source: str, now: float) -> int:
        """Failed proofs ``source`` is charged with at ``now`` (0 once forgotten)."""
        state = self._current(source, now)
        return 0 if state is None else state.failures

    def check(self, source: str, now: float) -> Throttled | None:
        """Whether a connection from ``source`` is refused at ``now``: None when it may try."""
        state = self._current(source, now)
        if state is None:
            return None
        if now < state.closed_until:
            return Throttled("source", state.closed_until - now, state.failures)
        tokens = self.tokens(now)
        if tokens < 1.0:
            wait = (1.0 - tokens) / self.limits.global_per_second
            return Throttled("global", wait, state.failures)
        return None

    def backoff_after_failure(self, source: str, now: float) -> float:
        """``source`` failed a proof at ``now``: charge it; the back-off it gets (0: none)."""
        state = self._current(source, now)
        if state is None:
            state = _Source()
            if len(self._sources) >= self.limits.max_sources:
                del self._sources[next(iter(self._sources))]
        else:
            del self._sources[source]  # re-inserted last: the dict stays in order of failure
        self._sources[source] = state
        tokens = self.tokens(now)
        spent = tokens < 1.0
        self._tokens, self._at = max(0.0, tokens - 1.0), now
        self.failures += 1
        state.failures += 1
        state.last = now
        backoff = self.limits.backoff(state.failures)
        if spent:  # the global budget is gone: no free failures for anyone
            backoff = max(backoff, self.limits.backoff(self.limits.free_failures + 1))
        state.closed_until = max(state.closed_until, now + backoff)
        return backoff

    def _current(self, source: str, now: float) -> _Source | None:
        state = self._sources.get(source)
        if state is None:
            return None
        if now - max(state.last, state.closed_until) >= self.limits.forget_after:
            del self._sources[source]
            return None
        return state

    def __len__(self) -> int:
        return len(self._sources)
