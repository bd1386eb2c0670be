"""Math with verifiable answers (``env.name: math``): a response earns 1 when its final answer is
mathematically equivalent to the prompt's reference answer, else 0.

The final answer is the content of the response's last ``\\boxed{...}`` (braces matched, so
``\\boxed{\\frac{1}{2}}`` is whole), else the last number in its text (``-5``, ``1,000``, ``2.5``,
``1/2``, ``\\frac{1}{2}``; units and currency signs around it left out). Equivalence is
math-verify's (Hugging Face's verifier, as in NeMo-RL's math environment), run in a child process
that is killed when a check takes longer than ``env.math.verify_timeout_s``
(:mod:`nemo_rl_mtp.tasks.math_verify_worker`), so no answer can stall a step, and the
environment works from any thread.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from nemo_rl_mtp.tasks.interfaces import TaskPrompt
from nemo_rl_mtp.tasks.tokenizer import TextTokenizer
from nemo_rl_mtp.tasks.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl_mtp.tasks.math_verify_worker import MathVerifyProcess
from nemo_rl_mtp.metrics import ANSWER_RATE

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number as written in prose: an optional sign (a minus right after a word, digit or closing
# bracket is subtraction, not a sign), digits with or without thousands separators, decimals, and a
# plain fraction; or a LaTeX fraction of two integers. A number glued to a word or to a decimal
# point on its left ("x2", "v1.2") is not one.
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER = re.compile(
    rf"(?:(?<![\w)\]}}])[-−])?"
    rf"(?:\\[dt]?frac\{{\s*-?\d+\s*\}}\{{\s*-?\d+\s*\}}|(?<![\w.]){_UNSIGNED}(?:\s*/\s*{_UNSIGNED})?)"
)

AnswerSource = Literal["boxed", "last_number"]


@dataclass(frozen=True)
class FinalAnswer:
    text: str
    source: AnswerSource


def final_answer(response: str) -> Optional[FinalAnswer]:
    """The response's final answer: its last non-empty, closed ``\\boxed{}``, else its last number
    (thousands separators dropped, a Unicode minus made ASCII), else None (no answer given)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return FinalAnswer(boxed, "boxed")
    numbers = _NUMBER.findall(response)
    if numbers:
        number = numbers[-1].replace("−", "-").replace(",", "")
        return FinalAnswer(number, "last_number")
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` whose brace is closed and which is not empty (a response
    cut off inside its box falls back to an earlier box)."""
    closing = _matching_braces(text)
    for match in reversed(list(_BOXED.finditer(text))):
        end = closing.get(match.end() - 1)
        if end is not None and text[match.end() : end].strip():
            return text[match.end() : end].strip()
    return None


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each closed ``{`` -> position of its ``}``, in one pass (linear in the text
    however many boxes are left open). Escaped braces (``\\{``) and ``\\\\`` are not structure."""
    closing, open_positions = {}, []
    position = 0
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2
            continue
        if char == "{":
            open_positions.append(position)
        elif char == "}" and open_positions:
            closing[open_positions.pop()] = position
        position += 1
    return closing


class MathEnvironment(EnvironmentInterface):
    """Rewards 1/0 for equivalent final answers; metrics add ``answer_rate``, the share of
    responses that gave an answer at all (the format metric).

    ``math_cfg.verify_timeout_s``: wall-clock limit of one equivalence check (seconds). A check
    that runs past it counts as wrong and costs that long, plus a worker restart (about 2 s on a
    2-core CPU) before the next check. Call :meth:`close` to end the worker early.
    """

    def __init__(self, math_cfg, tokenizer: TextTokenizer):
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("env.name=math needs the math-verify package (pip install math-verify==0.9.0)")
        self.tokenizer = tokenizer
        self.verifier = MathVerifyProcess(math_cfg.verify_timeout_s)

    def step(self, prompts: list[TaskPrompt], responses: list[list[int]]) -> EnvironmentReturn:
        """``responses``: B lists of token ids (each may run past its end-of-sequence token).
        Returns rewards ``[B]`` (float, 1.0 or 0.0) and per sample: ``answer`` (the extracted final
        answer or None), ``answered``, ``answer_source`` (``boxed`` / ``last_number`` / None),
        ``check`` (``equivalent`` / ``not_equivalent`` / ``timed_out`` / ``worker_died`` /
        ``no_answer``) and ``reference``."""
        rewards, metadata = [], []
        for prompt, response in zip(prompts, responses, strict=True):
            reference = str(prompt.answer)
            answer = final_answer(self.tokenizer.decode(response))
            check = "no_answer" if answer is None else self.verifier.check(answer.text, reference)
            rewards.append(1.0 if check == "equivalent" else 0.0)
            metadata.append(
                {
                    "answer": None if answer is None else answer.text,
                    "answered": answer is not None,
                    "answer_source": None if answer is None else answer.source,
                    "check": check,
                    "reference": reference,
                }
            )
        return EnvironmentReturn(torch.tensor(rewards, dtype=torch.float32), metadata)

    def demonstration(self, answer) -> str:
        """A correct response for the imitation warm start: the reference answer, boxed."""
        return f"\\boxed{{{answer}}}"

    def metrics(self, result: EnvironmentReturn) -> dict[str, float]:
        answered = [sample["answered"] for sample in result.metadata]
        return {**super().metrics(result), ANSWER_RATE: sum(answered) / max(len(answered), 1)}

    def close(self) -> None:
        self.verifier.close()
