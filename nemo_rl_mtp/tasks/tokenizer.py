"""Tokenizers of the policy: the digit tasks' own character-level one (models built from scratch),
and a Hugging Face checkpoint's (imported models, ``policy.model_name``).

Both give what rollouts and training need: ``vocab_size`` (ids the policy may sample; the output
layer may hold more), ``eos_id`` (ends a response), ``pad_id`` and ``response_tokens`` (a response
up to and including its end-of-sequence token).
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)


class DigitTokenizer:
    """The character-level tokenizer of the digit tasks: four specials and the ten digits."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    sep_id = 3  # "=", ends the prompt
    first_digit_id = 4
    vocab_size = 14

    def encode_prompt(self, digits: list[int]) -> list[int]:
        return [self.bos_id, *(self.first_digit_id + digit for digit in digits), self.sep_id]

    def encode_answer(self, digits: list[int]) -> list[int]:
        return [*(self.first_digit_id + digit for digit in digits), self.eos_id]

    def response_tokens(self, token_ids: list[int]) -> list[int]:
        """The response up to and including its first end-of-sequence token."""
        return _through_first(token_ids, self.eos_id)


class TextTokenizer:
    """A Hugging Face tokenizer as the policy's: prompts rendered through its chat template (where
    it has one and ``apply_chat_template``), responses are text followed by its end-of-sequence
    token."""

    def __init__(self, hf_tokenizer, apply_chat_template: bool):
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-sequence token (eos_token), so responses could never end")
        self.hf_tokenizer = hf_tokenizer
        self.eos_id: int = hf_tokenizer.eos_token_id
        self.pad_id: int = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size: int = len(hf_tokenizer)
        self.uses_chat_template = bool(apply_chat_template and getattr(hf_tokenizer, "chat_template", None))

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a user prompt: one user turn and the opening of the assistant's, when the
        chat template is used; the plain text otherwise."""
        if self.uses_chat_template:
            text = self.hf_tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return self.hf_tokenizer.encode(text, add_special_tokens=not self.uses_chat_template)

    def response_ids(self, text: str) -> list[int]:
        """Token ids of a response that says ``text`` and ends."""
        return [*self.hf_tokenizer.encode(text, add_special_tokens=False), self.eos_id]

    def response_tokens(self, token_ids: list[int]) -> list[int]:
        """The response up to and including its first end-of-sequence token."""
        return _through_first(token_ids, self.eos_id)

    def decode(self, token_ids: list[int]) -> str:
        """Text of a response (up to its end-of-sequence token), special tokens left out."""
        return self.hf_tokenizer.decode(self.response_tokens(token_ids), skip_special_tokens=True)


def load_tokenizer(model_name: Optional[str], trust_remote_code: bool, apply_chat_template: bool):
    """The checkpoint's tokenizer for an imported model, else the digit tasks' own."""
    if model_name is None:
        return DigitTokenizer()
    from transformers import AutoTokenizer

    return TextTokenizer(AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code), apply_chat_template)


def _through_first(token_ids: list[int], eos_id: int) -> list[int]:
    token_ids = list(token_ids)
    return token_ids[: token_ids.index(eos_id) + 1] if eos_id in token_ids else token_ids
