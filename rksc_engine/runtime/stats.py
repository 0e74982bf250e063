"""The engine's running counters: one ``EngineStats`` that the prefill, the model runner and the
scheduler add to, and from which the scheduler publishes snapshots."""

from __future__ import annotations

from ..results import EngineStats


class Counters:
    """Running totals (``EngineStats`` fields, or named extras), mutated only under the engine lock."""

    def __init__(self) -> None:
        self.totals = EngineStats()

    def count(self, counter: str, amount: int = 1) -> None:
        """Add ``amount`` to the ``EngineStats`` field ``counter``, or to ``extra[counter]`` for a
        counter that is not a field."""
        if counter in EngineStats.__dataclass_fields__ and counter != "extra":
            setattr(self.totals, counter, getattr(self.totals, counter) + amount)
        else:
            self.totals.extra[counter] = self.totals.extra.get(counter, 0) + amount

    def snapshot(self) -> EngineStats:
        """A copy of the totals (the caller fills in the cache and batch fields)."""
        snapshot = EngineStats(**{k: v for k, v in vars(self.totals).items() if k != "extra"})
        snapshot.extra = dict(self.totals.extra)
        return snapshot

    def reset(self) -> None:
        self.totals = EngineStats()
