"""The package's version (a leaf: the trace writer and the CLI read it too)."""

__version__ = "0.1.0"
