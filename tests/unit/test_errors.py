"""core/errors.py: the one-line cause chain a wrapper's reason is read from."""

from __future__ import annotations

from milepost.core.errors import cause_chain_line


def _ray_like_failure() -> ConnectionError:
    """What ray.init raises: a bare wrapper whose reason is only in its cause."""
    try:
        try:
            raise RuntimeError("No node info found for the raylet at 10.0.0.1\nsecond line of detail")
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from inner
    except ConnectionError as outer:
        return outer


def test_the_chain_names_every_cause_outermost_first_one_line_each():
    assert cause_chain_line(_ray_like_failure()) == (
        "ConnectionError: Failed to connect to Ray cluster at 10.0.0.1:6379 <- "
        "RuntimeError: No node info found for the raylet at 10.0.0.1")


def test_an_error_without_message_or_cause_is_its_type():
    assert cause_chain_line(TimeoutError()) == "TimeoutError: "
