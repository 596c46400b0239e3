"""Which programs a benchmark replays: the recorded SWE-bench Lite runs, a trace file, or the generator."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from thunderctl.bench.recorded import RECORDED_SWE_LITE_SOURCE, recorded_swe_lite
from thunderctl.bench.replay import TraceWorkload
from thunderctl.bench.swe_lite import TOOL_SECONDS, LogNormal, SweLite
from thunderctl.traceformat import read_trace


@dataclass(frozen=True)
class WorkloadChoice:
    """What `swe-lite` replays: the recorded runs (default), a trace file, or the generator."""

    trace: Path | None = None
    synthetic: bool = False
    tool_median: float | None = None
    tool_sigma: float | None = None
    tool_cap: float | None = None

    def problem(self) -> str:
        """Why the options do not go together, or ""."""
        if self.synthetic and self.trace is not None:
            return "--synthetic and --trace both name the workload: give one"
        if self.tool_overrides() and not self.synthetic:
            given = ", ".join(f"--tool-{name}" for name in self.tool_overrides())
            return f"{given} shape the synthetic tool times: add --synthetic (a trace has its own)"
        return ""

    def tool_overrides(self) -> dict[str, float]:
        given = {"median": self.tool_median, "sigma": self.tool_sigma, "cap": self.tool_cap}
        return {name: value for name, value in given.items() if value is not None}

    def tool_seconds(self) -> LogNormal:
        return replace(TOOL_SECONDS, **self.tool_overrides())

    def load(self, scale: float, shared_prefix: int, max_context: int | None) -> SweLite | TraceWorkload:
        if self.synthetic:
            return SweLite(scale, shared_prefix, max_context, tool_seconds=self.tool_seconds())
        if self.trace is None:
            programs, source, name = recorded_swe_lite(), RECORDED_SWE_LITE_SOURCE, "swe-lite"
        else:
            programs, source, name = read_trace(self.trace), str(self.trace), "trace"
        return TraceWorkload(scale, shared_prefix, max_context, programs=tuple(programs), source=source, name=name)
