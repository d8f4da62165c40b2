"""The built-in math verifiers on tricky answers: `gsm8k` (`#### 72`), `boxed` (`\\boxed{...}`) and
`math_verify` (the math-verify package, its signal timeouts off so that it runs off the main thread)."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from asyncrl.rewards import call_reward, check_reward, resolve_reward
from asyncrl.rewards.verifiers import gsm8k_answer, last_boxed
from tests.fakes import ThreadRewards


def score(rule: str, completion: str, answer: object) -> float:
    return call_reward(resolve_reward(rule, "answer"), "q", completion, {"answer": answer})


@pytest.mark.parametrize("completion, answer, expected", [
    ("so she has 72 left.\n#### 72", "72", 1.0),
    ("#### 72 apples in total", "72", 1.0),               # trailing text after the number
    ("#### 1,000", "1000", 1.0),                          # thousands separators
    ("#### $72", "72", 1.0),                              # currency
    ("#### 72.0", "72", 1.0),
    ("#### 72.50", "$72.5", 1.0),
    ("#### -5", "-5", 1.0),                               # negative numbers, either minus sign
    ("#### \u22125", "-5", 1.0),
    ("#### 5", "-5", 0.0),
    ("#### 0.5", "1/2", 1.0),
    ("#### 72", "48/2 = 24 clips in May, 48 + 24 = 72.\n#### 72", 1.0),  # the reference in GSM8K's own form
    ("#### 7", "#### 72", 0.0),
    ("#### 72 ... wait, #### 73", "73", 1.0),             # the last #### counts
    ("#### 73 ... wait, #### 72", "73", 0.0),
    ("The answer is 72", "72", 0.0),                      # no #### : no answer
    ("####", "72", 0.0),
    ("####\n72", "72", 1.0),
    ("#### 72", 72, 1.0),                                 # a numeric answer field
])
def test_gsm8k_reads_the_number_after_the_last_marker(completion, answer, expected):
    assert score("gsm8k", completion, answer) == expected


def test_gsm8k_reference_that_is_not_a_number_fails_the_sample_with_a_clear_line():
    with pytest.raises(ValueError, match=r"reward rule 'gsm8k': the reference answer 'seventy' is not a number"):
        score("gsm8k", "#### 70", "seventy")
    assert gsm8k_answer("x #### $1,234.5 dollars") == "1234.5" and gsm8k_answer("no marker 5") is None


@pytest.mark.parametrize("completion, answer, expected", [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),              # a fraction against a decimal
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),           # \dfrac, \frac12
    (r"\boxed{-\tfrac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),                # exact, not rounded
    (r"\boxed{1,000}", "1000", 1.0),
    (r"$\boxed{\$72}$", "72", 1.0),
    (r"\boxed{72.0}", "72", 1.0),
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{3}", "-3", 0.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),                   # units
    (r"\boxed{5\mbox{cm}^2}", "5", 0.0),                   # not a unit the rule knows: compared as text
    (r"\boxed{12 apples}", "12", 1.0),
    (r"\boxed{2x}", "2", 0.0),                             # a variable is not a unit
    (r"\boxed{50\%}", "50", 1.0),                          # percentages
    (r"\boxed{10^\circ}", "10", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"first \boxed{2}, finally \boxed{3}", "3", 1.0),     # the last box counts
    (r"first \boxed{3}, finally \boxed{2}", "3", 0.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),  # nested braces
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"\boxed 5", "5", 1.0),
    (r"\boxed{3", "3", 0.0),                               # unclosed
    ("the answer is 42", "42", 0.0),                       # no box: no answer
    (r"\boxed{}", "0", 0.0),
    (r"\boxed{\frac{1}{2}}", r"so the answer is $\boxed{0.5}$", 1.0),  # a boxed reference (MATH solutions)
])
def test_boxed_compares_the_last_box_as_normalised_text_or_exact_number(completion, answer, expected):
    assert score("boxed", completion, answer) == expected


def test_last_boxed_follows_nested_braces():
    assert last_boxed(r"x \boxed{\frac{a^{2}}{b}} y") == r"\frac{a^{2}}{b}"
    assert last_boxed(r"\boxed{1} \fbox{2}") == "2"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed("none") is None


# math_verify: the math-verify package is the optional extra asyncrl[math] (in asyncrl[test])


@pytest.mark.parametrize("completion, answer, expected", [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"The answer is $\dfrac{1}{2}$.", r"\frac{1}{2}", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{72.0}", "72", 1.0),
    (r"\boxed{-5}", "-5", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{1+x^2}", "x^2+1", 1.0),                     # symbolic equivalence
    (r"\boxed{\{2, 1\}}", r"\{1, 2\}", 1.0),
    ("#### 72", "72", 1.0),
    (r"\boxed{2} or \boxed{3}", "3", 0.0),                # hedging: math-verify reads both boxes
    ("I do not know", "3", 0.0),
    (r"\boxed{4}", "3", 0.0),
])
def test_math_verify_judges_equivalence(completion, answer, expected):
    pytest.importorskip("math_verify")
    assert score("math_verify", completion, answer) == expected


def test_math_verify_runs_off_the_main_thread_without_signals():
    pytest.importorskip("math_verify")
    fn = resolve_reward("math_verify", "answer")
    out: list = []
    worker = threading.Thread(target=lambda: out.append(call_reward(fn, "q", r"\boxed{\frac12}", {"answer": "0.5"})))
    worker.start()
    worker.join(30)
    assert out == [1.0]
    [result] = asyncio.run(ThreadRewards(fn).score([("q", r"$\frac{2}{4}$", {"answer": "0.5"})]))
    assert result.total == 1.0  # on the scorer's daemon thread, not a signal error


def test_math_verify_without_its_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    (line,) = check_reward("math_verify", "answer", "reward.functions[0].fn")
    assert line == "reward.functions[0].fn: 'math_verify' needs the math-verify package — pip install 'asyncrl[math]'"


def test_math_verify_reference_it_cannot_read_fails_the_sample():
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="cannot read the reference answer"):
        score("math_verify", r"\boxed{1}", "")
