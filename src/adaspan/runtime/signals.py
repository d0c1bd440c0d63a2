"""Signals between steps: a first SIGINT or SIGTERM becomes a value the loop checks after a
step (so that a checkpoint never holds half a step); a second one interrupts at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def deferred_signals() -> Iterator[Callable[[], int]]:
    """Turn the first SIGINT or SIGTERM into a value checked between steps (the signal's
    number; 0 while none came); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: 0
        return
    received = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal received
        if received:
            raise KeyboardInterrupt
        received = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: received
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
