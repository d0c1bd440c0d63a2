"""Expected failures. An error of this kind is the user's to fix (a bad option, a missing or
corrupt file, a run that diverged): the command line prints its message on one line and exits
with status 2, as it does for an OSError (the file system: a missing file, a full disk) and a
MemoryError. Any other exception is a bug and is reported as one (status 1).

Each module defines the subclasses of its own failures (``config.ConfigError``,
``checkpoint.RunDirError``, ``download.DataError``, ...)."""


class UserError(Exception):
    """A failure the user can act on; its message says what to change."""


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (its type's name if it has none): for an error that
    quotes another."""
    return " ".join(str(exc).split()) or type(exc).__name__
