"""Failed authentications and throttled connections, counted per serving endpoint of this
process, for the metrics (`paramsync.runtime.observe.metrics`).

An admission gate (`paramsync.runtime.transport.admission`) counts into the process's `TALLY`
under its endpoint's name (``"coordinator"``, ``"rank 2"``); a `Metrics` registry reads the
coordinator's counts, or a worker's (every other endpoint of its process), whenever it is
scraped. Counts only grow, so they are Prometheus counters whatever gates come and go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

__all__ = ["AdmissionTally", "TALLY"]


class AdmissionTally:
    """Counts per endpoint name: failed proofs of the secret, and connections refused because
    their source (or every source) spent its budget of failed proofs."""

    def __init__(self) -> None:
        self._failed: Counter[str] = Counter()
        self._throttled: Counter[tuple[str, str]] = Counter()

    def failed_authentication(self, endpoint: str) -> None:
        """A handshake at ``endpoint`` ended in a failed proof."""
        self._failed[endpoint] += 1

    def throttled(self, endpoint: str, scope: str) -> None:
        """A connection to ``endpoint`` was refused by the budget of ``scope`` (``"source"``
        or ``"global"``)."""
        self._throttled[endpoint, scope] += 1

    def failed(self, endpoints: Callable[[str], bool]) -> int:
        """Failed proofs at the endpoints ``endpoints`` accepts."""
        return sum(n for name, n in self._failed.items() if endpoints(name))

    def refused(self, endpoints: Callable[[str], bool]) -> dict[str, int]:
        """Connections refused by each scope of budget, at the endpoints ``endpoints`` accepts."""
        totals = {"source": 0, "global": 0}
        for (name, scope), n in self._throttled.items():
            if endpoints(name):
                totals[scope] = totals.get(scope, 0) + n
        return totals


TALLY = AdmissionTally()
"""This process's counts."""
