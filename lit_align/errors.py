"""The one exception type users see for their own mistakes (bad data, bad paths, bad settings).

The console script prints it as a single ``error: ...`` line and exits with status 2; anything else is a bug and keeps
its traceback.
"""


class LitAlignError(ValueError):
    """A problem with the user's input: the message names the file, row or field and what was expected."""


def one_line(exc: Exception, limit: int = 400) -> str:
    """An exception's message on one line (transformers' messages run over several; the first can end mid-sentence,
    e.g. "... from one of:"), cut at ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
