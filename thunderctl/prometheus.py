"""Prometheus text both ways, through prometheus_client: parse a scrape into samples, render families."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class MetricsParseError(ValueError):
    """Text that does not follow the Prometheus exposition format."""


def parse_samples(text: str, names: Collection[str] | None = None) -> list[Sample]:
    """Every sample of a Prometheus text exposition, by its own name (a counter's `_total`
    and `_created` samples included, as the page spells them); comments are skipped.

    With `names`, only samples so named, and lines of other series are not parsed at all: the
    parser is pure Python, and a vLLM page has some 600 lines of which a handful matter.
    """
    if names is not None:
        text = "\n".join(line for line in text.splitlines() if sample_name(line) in names)
    try:
        return samples_of(text)
    except ValueError as error:
        raise MetricsParseError(bad_line_of(text) or f"not Prometheus text: {error}") from None


def sample_name(line: str) -> str:
    """The name a sample line starts with; "" for a blank line, "#..." for a comment."""
    words = line.split("{", 1)[0].split(maxsplit=1)
    return words[0] if words else ""


def samples_of(text: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def bad_line_of(text: str) -> str | None:
    """Which line the parser trips on, to say so: the library's error does not name it."""
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            samples_of(line)
        except ValueError as error:
            return f"line {number} is not Prometheus text ({error or 'malformed'}): {line!r}"
    return None


class _Families:
    """A collector of families made for one scrape: the figures live elsewhere (the scheduler,
    the sandbox pool), so nothing is kept between scrapes."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def exposition(families: Iterable[Metric]) -> str:
    """The families as Prometheus text (format 0.0.4), label values escaped."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry).decode()
