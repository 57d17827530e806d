"""The one exception type users see for their own mistakes (bad data, bad paths, bad settings).

The console script prints it as a single ``error: ...`` line and exits with status 2; anything else is a bug and keeps
its traceback.
"""


class LitAlignError(ValueError):
    """A problem with the user's input: the message names the file, row or field and what was expected."""
