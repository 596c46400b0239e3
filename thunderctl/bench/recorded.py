"""The recorded SWE-bench Lite runs that ship with thunderctl as package data (docs/bench.md)."""

from __future__ import annotations

from importlib import resources

from thunderctl.traceformat import TraceProgram, read_trace

RECORDED_SWE_LITE = "swe-lite-gemini3.jsonl.gz"
RECORDED_SWE_LITE_SOURCE = "mini-swe-agent 1.15, Gemini 3 Pro, SWE-bench Lite (public results, MIT)"


def recorded_swe_lite() -> list[TraceProgram]:
    """The 93 SWE-bench Lite runs of mini-swe-agent, as trace programs."""
    with resources.as_file(resources.files("thunderctl.bench") / "data" / RECORDED_SWE_LITE) as path:
        return read_trace(path)
