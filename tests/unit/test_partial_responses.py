"""partial_rollout's bookkeeping against scripted /generate answers (the real engine path is
tests/integration/test_partial_rollout.py)."""

import pytest

from milepost.core.partial_rollout import MAX_CONTINUATIONS, PartialResponse, continue_cut_responses
from milepost.core.types import Prompt


def _answer(ids, version, reason):
    return {"output_ids": ids, "meta_info": {"weight_version": version, "finish_reason": {"type": reason},
                                             "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


def _response(max_new=6):
    return PartialResponse(Prompt(index=0, text="", label="", prompt_ids=[9, 9]), 0, seed=5, max_new_tokens=max_new)


def test_spans_record_each_version_and_continuations_ask_for_what_is_left():
    r = _response()
    r.absorb(_answer([1, 2], "3", "abort"))
    calls = []

    def generate(input_ids, params):
        calls.append((input_ids, params["max_new_tokens"], params["n"]))
        return [_answer([7, 8, 9, 10], "4", "length")]

    assert continue_cut_responses([r], {"max_new_tokens": 6, "temperature": 1.0}, generate) == 1
    assert calls == [([[9, 9, 1, 2]], 4, 1)]
    assert r.output_ids == [1, 2, 7, 8, 9, 10] and r.spans == [[0, "3"], [2, "4"]]
    assert r.finish_reason == "length" and r.weight_version == "4" and len(r.logprobs) == 6


def test_a_cut_with_no_tokens_adds_no_span_and_a_full_response_is_not_continued():
    r = _response(max_new=2)
    r.absorb(_answer([], "3", "abort"))
    assert r.spans == [] and r.needs_continuation()
    r.absorb(_answer([4, 5], "4", "abort"))  # cut, but nothing is left to generate
    assert r.spans == [[0, "4"]] and not r.needs_continuation()


def test_engines_that_abort_forever_fail_with_a_clear_error():
    r = _response()
    r.absorb(_answer([], "3", "abort"))
    with pytest.raises(RuntimeError, match=f"still cut after {MAX_CONTINUATIONS} continuations"):
        continue_cut_responses([r], {"max_new_tokens": 6}, lambda ids, p: [_answer([], "3", "abort")] * len(ids))
