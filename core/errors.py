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


def _causes(error: BaseException) -> list[BaseException]:
    """`error` and its chain of causes (`raise … from …`), outermost first."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 50:
        chain.append(chain[-1].__cause__)
    return chain


def user_error_in(error: BaseException) -> UserError | None:
    """The UserError that caused `error` (a wrapper such as a rollout thread's error keeps
    it as its cause), or None: then the failure is the runtime's."""
    return next((e for e in _causes(error) if isinstance(e, UserError)), None)


def root_error_line(error: BaseException) -> str:
    """`Type: message` on one line, of the user error behind `error` if there is one, else of
    its innermost cause: what a user needs to see first."""
    root = user_error_in(error) or _causes(error)[-1]
    text = " ".join(str(root).split()) or "(no message)"
    return f"{type(root).__name__}: {text}"


def cause_chain_line(error: BaseException) -> str:
    """`error` and each cause behind it, outermost first, on one line (`A: … <- B: …`), each
    message cut to its first line: for wrappers such as Ray's "Failed to connect to Ray
    cluster at …", whose reason is only in the cause."""
    return " <- ".join(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}" for e in _causes(error))
