"""One percentile for every figure thunderctl reports (bench, simulator, sandbox pool)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: int) -> float | None:
    """The q-th percentile (a whole number, 0-100) of the values, interpolating linearly between order
    statistics (numpy's default); None for no values.

    `statistics` rather than numpy: the gateway and the daemon report percentiles too, and numpy would
    add a tenth of a second to their start for this one function."""
    if not values:
        return None
    if len(values) == 1 or q <= 0:
        return min(values)
    if q >= 100:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
