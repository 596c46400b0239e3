#!/usr/bin/env python3
"""Convert mini-swe-agent's step table into the SWE-bench Lite trace that thunderctl ships.

    python3 scripts/convert-swe-lite-runs.py STEP_TABLE [--out FILE] [--decode-tokens-per-s R]

STEP_TABLE is the per-step table of mini-swe-agent's public SWE-bench Verified results
(`mini-swe-agent-gemini3-verified.jsonl`, one run per line). The runs marked `lite` are kept;
each step keeps its prompt and completion tokens, and `tool_s` is the gap to the next call
less the answer's generation at the decode rate fitted to those runs (docs/trace-format.md).
Only numbers are written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thunderctl.bench.importers import decode_rate, read_step_table
from thunderctl.bench.recorded import RECORDED_SWE_LITE, RECORDED_SWE_LITE_SOURCE
from thunderctl.traceformat import write_trace

PACKAGE_DATA = Path(__file__).resolve().parents[1] / "thunderctl" / "bench" / "data" / RECORDED_SWE_LITE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_table", type=Path, help="mini-swe-agent's step table (JSONL).")
    parser.add_argument("--out", type=Path, default=PACKAGE_DATA, help=f"The trace to write (default {PACKAGE_DATA}).")
    parser.add_argument("--decode-tokens-per-s", type=float, help="The recorded model's decode rate (default: fitted).")
    args = parser.parse_args()
    runs = read_step_table(args.step_table, lite_only=True, source=RECORDED_SWE_LITE_SOURCE)
    rate = args.decode_tokens_per_s or decode_rate(runs)
    count = write_trace((run.program(rate) for run in runs), args.out)
    print(f"{count} runs, decode rate {rate:.1f} tokens/s, written to {args.out}")


if __name__ == "__main__":
    main()
