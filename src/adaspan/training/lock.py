"""One writer per run directory: an advisory lock (``flock``) on the directory itself, held
while a process trains there. The operating system releases it when the process ends, however
it ends (SIGKILL included), so a lock left by a dead process never blocks the next one. While
it holds the lock, the writer's process id is in ``.writer``, for the message that refuses a
second writer. Readers (evaluate, generate, report) take no lock."""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from .distributed import Distributed

WRITER_FILE = ".writer"  # in the run directory while a writer holds it: its process id


class RunLockedError(UserError):
    """Another process is writing the run directory."""


class WriterLock:
    """The lock of ``folder``'s writer (an existing directory): :meth:`acquire` it
    (RunLockedError naming the holder's pid where another process holds it), :meth:`release`
    it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pid_file = folder / WRITER_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(
                f"{self.folder} is being written by another process (pid {self._holder()}); "
                "wait for it to end or stop it"
            ) from None
        self._fd = fd
        self.pid_file.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        if self._fd is not None:
            self.pid_file.unlink(missing_ok=True)
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def _holder(self) -> str:
        try:
            return self.pid_file.read_text().strip() or "unknown"
        except OSError:
            return "unknown"


@contextmanager
def writing(folder: Path, dist: Distributed) -> Iterator[None]:
    """Hold the writer lock of run directory ``folder`` while training there (rank 0 holds it
    for every rank of a job): a second writer is refused, on every rank, before anything is
    read or written (:class:`RunLockedError`). A folder made only to hold the lock is removed
    again if nothing else was written to it."""
    made = not folder.exists()
    lock, refused = WriterLock(folder), None
    if dist.is_main:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except RunLockedError as exc:
            refused = exc
        except OSError:  # not writable: the run directory's checks say so
            made = False
    if dist.agree([refused is not None])[0]:
        raise refused or RunLockedError(f"{folder} is being written by another process")
    try:
        yield
    finally:
        lock.release()
        if made and dist.is_main and not any(folder.iterdir()):
            folder.rmdir()
