"""The one exception type for user mistakes, shared by every layer.

A `UserError` is raised for what the user gave: a recipe value, a flag, a dataset row, a
model path, a reward function that raises or returns NaN for a whole step. Its message names
the problem and the fix. It is deterministic — running it again gives the same error — so a
stage that fails with it records `error_kind: user`, exits 2, and neither Airflow nor the
block driver retries it; the CLI prints its message without a traceback.

Anything else is a runtime failure (a node lost, a process killed, a timeout): recorded as
`error_kind: runtime` and retried.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; the message says what to change."""


def root_error_line(error: BaseException) -> str:
    """`Type: message` of the innermost cause, on one line: what a user needs to see first."""
    while error.__cause__ is not None and not isinstance(error, UserError):
        error = error.__cause__
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text}"
