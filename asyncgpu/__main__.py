"""``python -m asyncgpu``: the command line (see ``asyncgpu --help``)."""

from __future__ import annotations

import sys

from ._tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
