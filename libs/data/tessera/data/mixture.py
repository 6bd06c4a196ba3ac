"""Dataset mixtures: which dataset each global window comes from, a pure function of its index.

Windows are dealt in rounds of M. Among the first t windows, dataset d (d not the heaviest)
gets floor(t * w_d) and the heaviest dataset the rest, so each dataset's share is within one
window of its weight at every round end, whatever the length of the run; inside a round the
datasets' windows are placed by a permutation seeded with (seed, round). A window's dataset and
how many windows each dataset gave before it follow from the window index alone, so the
loader's state stays one global position.
"""

from __future__ import annotations

import math

import numpy as np

_ROUND = 4096


def parse_mixture(entries: list[str]) -> list[tuple[str, float]]:
    """["path=weight", ...] -> [(path, weight), ...]; one error line names a bad entry."""
    parsed = []
    for entry in entries:
        path, sep, raw = entry.rpartition("=")
        if not sep or not path.strip():
            raise ValueError(f"dataset mixture entry {entry!r}: expected 'path=weight'")
        try:
            weight = float(raw)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"dataset mixture entry {entry!r}: weight {raw.strip()!r} must be a positive number")
        parsed.append((path.strip(), weight))
    return parsed


class Mixture:
    """The dataset of each window for positive, finite, relative `weights`: normalised to sum 1
    after scaling by the largest, so that no size overflows (1e308, 1e308 is an even mix, while
    their plain sum is inf and would make every weight 0)."""

    def __init__(self, weights: list[float], seed: int):
        if not weights or any(not (math.isfinite(w) and w > 0) for w in weights):
            raise ValueError(f"mixture weights must be positive numbers, got {weights}")
        scaled = np.asarray(weights, dtype=np.float64) / max(weights)
        self.weights = scaled / scaled.sum()
        self._seed = seed
        self._heaviest = int(np.argmax(self.weights))
        # Rounds of at least D^2 windows keep the heaviest dataset's per-round count >= 0.
        self._round = max(_ROUND, len(weights) ** 2)
        self._cached: tuple[int, np.ndarray] | None = None  # (round, dataset of each window)

    def reseed(self, seed: int) -> None:
        self._seed, self._cached = seed, None

    def counts(self, windows: int) -> np.ndarray:
        """Windows each dataset gives among the first `windows` (complete rounds only)."""
        counts = np.floor(windows * self.weights).astype(np.int64)
        counts[self._heaviest] = 0
        counts[self._heaviest] = windows - counts.sum()
        return counts

    def counts_before(self, window: int) -> np.ndarray:
        """Windows each dataset gives before global window `window` (any index)."""
        start = window - window % self._round
        return self.counts(start) + np.bincount(self._round_of(start)[: window - start], minlength=len(self.weights))

    def dataset_of(self, window: int) -> int:
        start = window - window % self._round
        return int(self._round_of(start)[window - start])

    def _round_of(self, start: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != start:
            per_dataset = self.counts(start + self._round) - self.counts(start)
            datasets = np.repeat(np.arange(len(self.weights)), per_dataset)
            np.random.default_rng([self._seed, start // self._round]).shuffle(datasets)
            self._cached = (start, datasets)
        return self._cached[1]
