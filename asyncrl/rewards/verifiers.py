"""Built-in math verifiers: `gsm8k`, `boxed` and `math_verify` reward rules (registered lazily in rules.py).

Place in the dataflow: like every rule, `reward.fn = "gsm8k"` (or a [[reward.functions]] entry) resolves to
`fn(prompt, completion, **fields) -> 1.0 | 0.0`, comparing the completion's final answer with the row's
reference (`reward.answer_key`). A completion without a final answer scores 0.0; a reference that cannot be
read is a ValueError (the sample fails and is counted: the dataset, not the policy, is wrong).

| rule          | the completion's answer                         | equal when                                      |
|---------------|-------------------------------------------------|-------------------------------------------------|
| `gsm8k`       | the first number after the last `####`          | the same number (`1,000` = `1000`, `72.0` = 72, |
|               |                                                 | `$72` = 72); the reference may be `... #### 72` |
| `boxed`       | the last `\\boxed{...}` / `\\fbox{...}` (nested   | the same string after MATH-style normalisation, |
|               | braces)                                         | or the same number (`\\frac{1}{2}` = 0.5)        |
| `math_verify` | what the math-verify package extracts           | math-verify's `verify` (symbolic equivalence)   |

`boxed` normalises both sides as the MATH benchmark's grader does: spaces, `$`, `\\left`/`\\right`, `\\!`,
`\\dfrac`/`\\tfrac` → `\\frac`, `\\frac12` → `\\frac{1}{2}`, `\\sqrt3` → `\\sqrt{3}`, degrees `^\\circ`, a
percent sign (`50\\%` = 50), thousands commas, units after a number (`5 \\text{ cm}`, `5 cm` = 5), a leading
`x =`. Numbers compare exactly as fractions (`0.5` = `\\frac{1}{2}` = `1/2`, but `0.33` ≠ `\\frac{1}{3}`).

`math_verify` runs math-verify with its own signal-based timeouts off (SIGALRM works only on the main thread,
and scorers call rewards on worker threads or in worker processes): `reward.timeout_s` bounds each call
instead. It needs the optional extra: pip install 'asyncrl[math]'.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

from asyncrl.rewards.rules import RewardFn, _answer

# -- gsm8k ---------------------------------------------------------------------------------------------

_GSM8K_NUMBER = re.compile(r"([-+]?)\s*\$?\s*(\d[\d,]*(?:\.\d+)?|\.\d+)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last '####' in `text` ('#### $1,000.50 apples' -> '1000.50'), or None."""
    at = text.rfind("####")
    if at < 0:
        return None
    m = _GSM8K_NUMBER.search(text[at + 4:].replace("\u2212", "-"))
    return None if m is None else m.group(1).replace("+", "") + m.group(2).replace(",", "")


def _gsm8k_reference(answer: str) -> Fraction:
    text = gsm8k_answer(answer) if "####" in answer else answer.replace("\u2212", "-")
    number = _number(_plain(text)) if text is not None else None
    if number is None:
        raise ValueError(f"reward rule 'gsm8k': the reference answer {answer!r} is not a number "
                         f"(nor '... #### <number>') — check reward.answer_key")
    return number


def gsm8k_rule(answer_key: str) -> RewardFn:
    def gsm8k(prompt: str, completion: str, **fields: Any) -> float:
        reference = _gsm8k_reference(_answer("gsm8k", answer_key, fields))
        got = gsm8k_answer(completion)
        return 1.0 if got is not None and _number(got) == reference else 0.0

    return gsm8k


# -- boxed ---------------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` in `text` (braces nested to any depth), or of
    a `\\boxed 5` without braces; None when there is none or its braces do not close."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    if text[i:i + 1] == " " and text[i + 1:i + 2] not in ("", "{"):  # `\boxed 5`: up to the next space or $
        m = re.match(r" ([^\s$]+)", text[i:])
        return m.group(1) if m else None
    while text[i:i + 1].isspace():
        i += 1
    if text[i:i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{" and text[j - 1:j] != "\\":
            depth += 1
        elif text[j] == "}" and text[j - 1:j] != "\\":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def _fix_fracs(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}."""
    s = re.sub(r"\\frac(?=\d)(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)(?=\{)", r"\\frac{\1}", s)
    return re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)


_UNIT_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .^0-9]*\}")
_NUMBER_TEXT = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"


def _plain(s: str) -> str:
    """MATH-style normalisation of an answer string (see the module docstring)."""
    s = s.strip().replace("\n", "").replace("\u2212", "-").rstrip(".")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    number_then_unit = re.fullmatch(rf"({_NUMBER_TEXT})\s*(?:{_UNIT_TEXT.pattern}|[A-Za-z]{{2,}}(?: [A-Za-z]+)*)", s)
    if number_then_unit:  # '5 \text{ cm}', '72 apples' (not '2x': a single letter is a variable)
        s = number_then_unit.group(1)
    lhs, eq, rhs = s.partition("=")
    if eq and len(lhs.strip()) <= 2 and "=" not in rhs:  # 'x = 5' -> '5'
        s = rhs
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators, not a tuple
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    return s


def _number(s: str) -> Fraction | None:
    r"""An exact number from a normalised answer: '72', '-0.5', '1/2', '\frac{1}{2}', '-\frac{3}{4}'."""
    m = re.fullmatch(r"([-+]?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s) or re.fullmatch(r"([-+]?)([\d.]+)/([\d.]+)", s)
    try:
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) == "-" else value
        if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        pass
    return None


def boxed_equal(got: str, reference: str) -> bool:
    """Whether two answers are equal as the `boxed` rule judges them (normalised strings, exact numbers)."""
    a, b = _plain(got), _plain(reference)
    if a == b:
        return bool(a)
    x, y = _number(a), _number(b)
    return x is not None and x == y


def boxed_rule(answer_key: str) -> RewardFn:
    def boxed(prompt: str, completion: str, **fields: Any) -> float:
        answer = _answer("boxed", answer_key, fields)
        reference = last_boxed(answer) if _BOX.search(answer) else answer
        if not reference:
            raise ValueError(f"reward rule 'boxed': the reference answer {answer!r} is empty — check "
                             f"reward.answer_key")
        got = last_boxed(completion)
        return 1.0 if got is not None and boxed_equal(got, reference) else 0.0

    return boxed


# -- math_verify ---------------------------------------------------------------------------------------


def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        import math_verify
        from math_verify import parse, verify
    except ImportError:
        raise ValueError("reward.fn: 'math_verify' needs the math-verify package — pip install 'asyncrl[math]'") \
            from None
    # Its one-time "timeout is disabled" warning asks the caller to bound calls: reward.timeout_s does.
    for module in (getattr(math_verify, "parser", None), getattr(math_verify, "grader", None)):
        if module is not None and hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True
    return parse, verify


def math_verify_rule(answer_key: str) -> RewardFn:
    parse, verify = _math_verify()

    def math_verify(prompt: str, completion: str, **fields: Any) -> float:
        answer = _answer("math_verify", answer_key, fields)
        # a bare reference ('\frac{1}{2}', '0.5') is LaTeX without delimiters: math-verify wants them
        gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=None) \
            or parse(answer, parsing_timeout=None)
        if not gold:
            raise ValueError(f"reward rule 'math_verify': math-verify cannot read the reference answer {answer!r}")
        got = parse(completion, parsing_timeout=None)
        return 1.0 if got and verify(gold, got, timeout_seconds=None) else 0.0

    return math_verify
