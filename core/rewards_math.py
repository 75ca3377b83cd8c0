"""GSM8K-style math reward: the response's final number equals the label's, numerically.

The answer is read from the response in this order, the last occurrence winning each time,
because models restate intermediate results before concluding:
1. `\\boxed{...}` (nested braces allowed: `\\boxed{\\frac{1}{2}}`);
2. what follows `####` (GSM8K's own answer marker);
3. what follows `answer is` / `answer:` (case-insensitive);
4. the last number anywhere in the response.
The label may be a bare number (`72`) or a whole GSM8K solution ending in `#### 72`.
Numbers are compared as exact rationals after removing thousands separators, currency and
percent signs and units: `$1,234.50` == `1234.5`, `\\frac{3}{4}` == `0.75` == `3/4`.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?"
_FRAC = re.compile(r"\\d?frac\s*\{\s*([-+]?[\d.,]+)\s*\}\s*\{\s*([-+]?[\d.,]+)\s*\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, matching nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unclosed: not an answer


def parse_number(text: str) -> Fraction | None:
    """The first number in `text` as an exact fraction, or None."""
    text = _FRAC.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text).replace("$", "").replace("\\%", "%")
    m = re.search(_NUMBER, text)
    if m is None:
        return None
    raw = m.group(0).replace(",", "").replace(" ", "")
    try:
        if "/" in raw:
            num, den = raw.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response: str) -> Fraction | None:
    """The response's final numeric answer (see the module docstring for the order)."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return parse_number(boxed)
    if "####" in response:
        return parse_number(response.rsplit("####", 1)[1])
    marks = list(_ANSWER_IS.finditer(response))
    if marks:
        found = parse_number(response[marks[-1].end():])
        if found is not None:
            return found
    numbers = re.findall(_NUMBER, _FRAC.sub(lambda m: f"{m.group(1)}/{m.group(2)}", response))
    return parse_number(numbers[-1]) if numbers else None


def label_answer(label: str) -> Fraction:
    """The reference number: after `####` when the label is a full GSM8K solution."""
    value = parse_number(label.rsplit("####", 1)[-1])
    if value is None:
        raise ValueError(f"GSM8K label {label[-80:]!r} holds no number; the dataset's label_key must name "
                         "the answer column (e.g. `answer`, ending in `#### <number>`)")
    return value


def gsm8k_reward(response_text: str, label: str) -> float:
    """1.0 when the response's final number equals the label's, else 0.0."""
    answer = extract_answer(response_text)
    return 1.0 if answer is not None and answer == label_answer(label) else 0.0
