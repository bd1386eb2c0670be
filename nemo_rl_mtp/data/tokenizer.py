"""The character-level tokenizer of the digit tasks: four specials and the ten digits."""

from __future__ import annotations


class DigitTokenizer:
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
        if self.eos_id in token_ids:
            return token_ids[: token_ids.index(self.eos_id) + 1]
        return list(token_ids)
