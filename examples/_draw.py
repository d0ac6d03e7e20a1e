"""The examples' timeline picture, drawn by asyncgpu's command line
(``python -m asyncgpu trace FILE.json --png OUT.png``), which needs matplotlib
(the ``plot`` extra). Without it, the examples say so and go on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def draw(trace_json: Path, png: Path, title: str) -> None:
    """Draw the saved trace with asyncgpu's command line (``python -m asyncgpu trace``),
    which needs matplotlib (the ``plot`` extra); without it, say so and go on."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgpu",
            "trace",
            str(trace_json),
            "--png",
            str(png),
            "--title",
            title,
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        print(f"timeline: {png}")
    else:
        print(f"timeline: skipped ({r.stderr.strip() or r.stdout.strip()})")
