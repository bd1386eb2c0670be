"""The math environment against a hand-written table: responses encoded with a real byte-level
BPE tokenizer (the tiny MiMo checkpoint's), judged by the real math-verify in its worker process.
Every expected reward and answered flag below is written out by hand."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from nemo_rl_mtp.tasks.interfaces import TaskPrompt
from nemo_rl_mtp.tasks.tokenizer import TextTokenizer
from nemo_rl_mtp.tasks.math_environment import MathEnvironment


from scripts.tiny_mimo_checkpoint import build_tokenizer  # noqa: E402

# (response text, reference answer, expected reward, expected answered)
CASES = [
    # Several numbers: the last one counts, or the boxed one wherever it is.
    ("Tom has 3 apples, buys 5 and then 34 more, so he has 42.", "42", 1.0, True),
    ("In all 42. Check: 42 - 30 = 12", "42", 0.0, True),
    ("The sum is 40 plus 2, so \\boxed{42}. (We carried 1 twice.)", "42", 1.0, True),
    # Units and currency.
    ("He has 42 apples.", "42", 1.0, True),
    ("It costs $5.", "5", 1.0, True),
    ("The side is 5 cm long.", "5", 1.0, True),
    ("So the side is \\boxed{5 \\text{ cm}}.", "5", 1.0, True),
    ("She pays \\boxed{\\$5}.", "5", 1.0, True),
    # Negative numbers; a hyphen after a digit is not a sign.
    ("The temperature fell to -5 degrees.", "-5", 1.0, True),
    ("It dropped to −5 overnight.", "-5", 1.0, True),
    ("So x is \\boxed{-5}.", "5", 0.0, True),
    ("The answer is 5.", "-5", 0.0, True),
    ("Read pages 3-5.", "5", 1.0, True),
    # Fractions, as LaTeX, decimals and slashes.
    ("The probability is \\boxed{\\frac{1}{2}}.", "0.5", 1.0, True),
    ("Half of it is 0.5", "\\frac{1}{2}", 1.0, True),
    ("The probability is 1/2.", "\\frac{1}{2}", 1.0, True),
    ("The probability is $\\frac{1}{2}$.", "0.5", 1.0, True),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0, True),
    ("The probability is 1/3.", "0.5", 0.0, True),
    # Thousands separators.
    ("About 1,000 people came.", "1000", 1.0, True),
    ("\\boxed{1,000}", "1000", 1.0, True),
    ("So 1000 in all.", "1,000", 1.0, True),
    ("\\boxed{1,234,567}", "1234567", 1.0, True),
    ("About 100,000 people came.", "1,000,000", 0.0, True),
    # Decimals.
    ("Pi is about 3.14", "3.14", 1.0, True),
    ("She paid 2.50 dollars.", "2.5", 1.0, True),
    ("\\boxed{3.15}", "3.14", 0.0, True),
    ("The answer is \\boxed{42.}", "42", 1.0, True),
    # Nested braces inside the box.
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0, True),
    ("\\boxed{2^{10}}", "1024", 1.0, True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{1}{2}", 0.0, True),
    # Several boxes: the last closed, non-empty one counts.
    ("First \\boxed{24}, then corrected to \\boxed{42}.", "42", 1.0, True),
    ("\\boxed{42}, no wait, \\boxed{24}.", "42", 0.0, True),
    ("So \\boxed{42}. Or maybe \\boxed{2", "42", 1.0, True),
    ("\\boxed{} so 42", "42", 1.0, True),
    # LaTeX against plain text.
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0, True),
    ("\\boxed{x = 5}", "5", 1.0, True),
    ("\\boxed{\\pi}", "\\pi", 1.0, True),
    ("\\boxed{3.14}", "\\pi", 0.0, True),
    # Wrong answers.
    ("The answer is 24.", "42", 0.0, True),
    ("\\boxed{24}", "42", 0.0, True),
    # No answer at all.
    ("I do not know.", "42", 0.0, False),
    ("", "42", 0.0, False),
    ("\\boxed{}", "42", 0.0, False),
]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(build_tokenizer(), apply_chat_template=False)


@pytest.fixture(scope="module")
def env(tokenizer):
    environment = MathEnvironment(SimpleNamespace(verify_timeout_s=10.0), tokenizer)
    yield environment
    environment.close()


def prompt(reference: str) -> TaskPrompt:
    return TaskPrompt(prompt_ids=[0], answer=reference)


def test_the_table_of_answers(env, tokenizer):
    responses = [tokenizer.response_ids(text) for text, *_ in CASES]
    # The tokenizer gives the text back, so the table tests the environment, not the tokenizer.
    assert [tokenizer.decode(ids) for ids in responses] == [text for text, *_ in CASES]
    result = env.step([prompt(reference) for _, reference, *_ in CASES], responses)
    got = [
        (text, reference, reward, sample["answered"])
        for (text, reference, *_), reward, sample in zip(CASES, result.rewards.tolist(), result.metadata)
    ]
    assert got == CASES
    assert {sample["check"] for sample in result.metadata} == {"equivalent", "not_equivalent", "no_answer"}


def test_what_the_metadata_says(env, tokenizer):
    texts = ["Then \\boxed{\\frac{1}{2}} of 7", "So 1,000 apples", "Nothing here."]
    result = env.step([prompt("0.5"), prompt("999"), prompt("1")], [tokenizer.response_ids(text) for text in texts])
    assert result.metadata == [
        {"answer": "\\frac{1}{2}", "answered": True, "answer_source": "boxed", "check": "equivalent", "reference": "0.5"},
        {"answer": "1000", "answered": True, "answer_source": "last_number", "check": "not_equivalent", "reference": "999"},
        {"answer": None, "answered": False, "answer_source": None, "check": "no_answer", "reference": "1"},
    ]


def test_text_after_the_end_of_sequence_token_is_ignored(env, tokenizer):
    def after_eos(text: str, tail: str) -> list[int]:
        return tokenizer.response_ids(text) + tokenizer.hf_tokenizer.encode(tail, add_special_tokens=False)

    responses = [
        after_eos("The answer is 24.", "Actually \\boxed{42}"),
        after_eos("I am not sure.", "42"),
        after_eos("\\boxed{42}", "\\boxed{24}"),
    ]
    result = env.step([prompt("42")] * 3, responses)
    assert result.rewards.tolist() == [0.0, 0.0, 1.0]
    assert [sample["answered"] for sample in result.metadata] == [True, False, True]


def test_metrics_add_the_answer_rate(env, tokenizer):
    texts = ["\\boxed{42}", "\\boxed{24}", "It is 7.", "No idea."]
    result = env.step([prompt("42")] * 4, [tokenizer.response_ids(text) for text in texts])
    assert env.metrics(result) == {"reward": 0.25, "accuracy": 0.25, "answer_rate": 0.75}


def test_works_outside_the_main_thread(env, tokenizer):
    """math-verify's own time limits (signal.alarm) refuse to run outside the main thread; ours
    do not depend on the thread."""
    responses = [tokenizer.response_ids("\\boxed{\\frac{1}{2}}"), tokenizer.response_ids("4")]
    with ThreadPoolExecutor(max_workers=1) as pool:
        thread, result = pool.submit(
            lambda: (threading.current_thread(), env.step([prompt("0.5"), prompt("3")], responses))
        ).result()
    assert thread is not threading.main_thread()
    assert result.rewards.tolist() == [1.0, 0.0]


# 9^(9^(9^9)) has more digits than there are atoms in the universe; sympy tries anyway.
PATHOLOGICAL = "So the answer is \\boxed{9^{9^{9^{9}}}}."


@pytest.mark.slow
def test_a_pathological_answer_is_cut_off_at_the_time_limit(tokenizer):
    """With a 0.5 s limit the check ends (wrong, timed out) within 0.5 s plus the kill's slack,
    from a thread other than the main one; the control, the same check allowed 2 s, is still
    running when its limit ends it, so the limit is what ended the first. The worker is replaced:
    the next answer is judged."""
    pathological = [tokenizer.response_ids(PATHOLOGICAL)]
    limited = MathEnvironment(SimpleNamespace(verify_timeout_s=0.5), tokenizer)
    control = MathEnvironment(SimpleNamespace(verify_timeout_s=2.0), tokenizer)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            start = time.monotonic()
            result = pool.submit(limited.step, [prompt("42")], pathological).result()
            elapsed = time.monotonic() - start
        assert result.rewards.tolist() == [0.0]
        assert result.metadata[0]["check"] == "timed_out"
        assert result.metadata[0]["answered"] is True
        assert 0.5 <= elapsed < 1.5, elapsed

        start = time.monotonic()
        result = control.step([prompt("42")], pathological)
        assert time.monotonic() - start >= 2.0
        assert result.metadata[0]["check"] == "timed_out"

        after = limited.step([prompt("42")], [tokenizer.response_ids("\\boxed{42}")])
        assert after.rewards.tolist() == [1.0]
        assert after.metadata[0]["check"] == "equivalent"
    finally:
        limited.close()
        control.close()


@pytest.mark.slow
def test_the_worker_dies_with_its_driver():
    """A driver killed (kill -9) while a check runs does not leave its worker computing on."""
    driver_code = (
        "from nemo_rl_mtp.tasks.math_verify_worker import MathVerifyProcess\n"
        "verifier = MathVerifyProcess(timeout_s=600.0)\n"
        "print('started', flush=True)\n"
        "verifier.check('9^{9^{9^{9}}}', '42')\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", driver_code], stdout=subprocess.PIPE, text=True)
    workers = []
    try:
        assert driver.stdout.readline() == "started\n"
        workers = psutil.Process(driver.pid).children()
        assert len(workers) == 1 and workers[0].is_running()
        time.sleep(0.5)  # the check is under way
        driver.kill()
        driver.wait()
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert alive == []
    finally:
        for process in [driver, *workers]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        driver.wait()
        driver.stdout.close()


@pytest.mark.slow
def test_a_worker_that_dies_during_a_check_is_replaced(tokenizer):
    """A worker that dies mid-check (a crash in sympy, the out-of-memory killer) costs that
    answer its reward, not the step; the next check gets a new worker."""
    before = {child.pid for child in psutil.Process().children()}
    env = MathEnvironment(SimpleNamespace(verify_timeout_s=60.0), tokenizer)
    try:
        (worker,) = [child for child in psutil.Process().children() if child.pid not in before]
        threading.Timer(0.5, worker.kill).start()
        start = time.monotonic()
        result = env.step([prompt("42")], [tokenizer.response_ids(PATHOLOGICAL)])
        assert time.monotonic() - start < 5.0
        assert result.rewards.tolist() == [0.0]
        assert result.metadata[0]["check"] == "worker_died"
        after = env.step([prompt("42")], [tokenizer.response_ids("\\boxed{42}")])
        assert after.rewards.tolist() == [1.0]
    finally:
        env.close()
