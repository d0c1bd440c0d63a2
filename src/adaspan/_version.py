"""The package version (single source: pyproject reads it from here)."""

__version__ = "0.13.0"
