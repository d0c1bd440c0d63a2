"""One writer per run directory: an advisory lock (``flock``) on the directory itself, held
while a process trains there. The operating system releases it when the process ends, however
it ends (SIGKILL included), so a lock left by a dead process never blocks the next one. While
it holds the lock, the writer's process id is in ``.writer``, for the message that refuses a
second writer. Readers (evaluate, generate, report) take no lock."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ..errors import UserError
from ..runtime.distributed import Distributed

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
        self.made = False  # the folder was made to be locked
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
        """Release the lock; a folder made to be locked goes too if nothing was written."""
        if self._fd is not None:
            self.pid_file.unlink(missing_ok=True)
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
            if self.made and not any(self.folder.iterdir()):
                self.folder.rmdir()

    def _holder(self) -> str:
        try:
            return self.pid_file.read_text().strip() or "unknown"
        except OSError:
            return "unknown"


def hold(folder: Path, dist: Distributed) -> WriterLock:
    """The writer lock of run directory ``folder``, made if new, taken by rank 0 for every
    rank of a job: a second writer is refused on every rank (:class:`RunLockedError`)."""
    lock, refused = WriterLock(folder), None
    if dist.is_main:
        lock.made = not folder.exists()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except (RunLockedError, OSError) as exc:
            refused = exc
    if dist.agree([refused is not None])[0]:
        raise refused or RunLockedError(
            f"{folder} is being written by another process (rank 0 could not take its lock)")
    return lock
