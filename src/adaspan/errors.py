"""Expected failures. An error of this kind is the user's to fix (a bad option, a missing or
corrupt file, a run that diverged): the command line prints its message on one line and exits
with status 2. Any other exception is a bug and is reported as one (status 1)."""


class UserError(Exception):
    """A failure the user can act on; its message says what to change."""
