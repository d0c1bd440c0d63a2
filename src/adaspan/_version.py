"""The package version (single source: pyproject reads it from here)."""

__version__ = "0.19.0"


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.12.0"`` as ``(0, 12, 0)``: the leading number of each dot-separated part (0 where
    a part has none), so that versions compare as tuples."""
    numbers = []
    for part in version.split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        numbers.append(int(digits or 0))
    return tuple(numbers)
