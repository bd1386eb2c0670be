from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nemo_rl_mtp.tasks.tokenizer import DigitTokenizer
from nemo_rl_mtp.tasks.digit_tasks import DigitTaskEnvironment, DigitTaskPrompts, answer_reward, expected_answer

DIGITS_CFG = OmegaConf.create({"task": "sort", "min_digits": 2, "max_digits": 4})


@pytest.mark.parametrize(
    "task, digits, answer",
    [("reverse", [3, 1, 4], [4, 1, 3]), ("sort", [3, 1, 4], [1, 3, 4]), ("count_up", [3, 9], [0, 1])],
)
def test_expected_answers(task, digits, answer):
    assert expected_answer(task, digits) == answer


def test_reward_gives_partial_credit_and_penalises_length():
    assert answer_reward([4, 1, 3], [4, 1, 3]) == 1.0
    assert answer_reward([4, 1, 3], [4, 0, 3]) == pytest.approx(2 / 3)
    assert answer_reward([4, 1, 3], [4, 1, 3, 3]) == pytest.approx(3 / 4)  # an extra token
    assert answer_reward([4, 1, 3], [4, 1]) == pytest.approx(2 / 3)  # a missing token
    assert answer_reward([4, 1, 3], []) == 0.0


def test_rewards_compare_answers_up_to_end_of_sequence():
    tokenizer = DigitTokenizer()
    env = DigitTaskEnvironment(OmegaConf.create({"task": "reverse", "min_digits": 2, "max_digits": 4}), tokenizer)
    answer = tokenizer.encode_answer([2, 1])  # "2 1 </s>"
    junk_after_eos = answer + [tokenizer.first_digit_id + 5]
    no_eos = answer[:-1]  # stopping is part of the answer
    bos_inside = [tokenizer.first_digit_id + 2, tokenizer.bos_id, tokenizer.eos_id]
    stops_early = [tokenizer.first_digit_id + 2, tokenizer.eos_id]
    rewards = env.rewards([[1, 2]] * 5, [answer, junk_after_eos, no_eos, bos_inside, stops_early])
    assert rewards == pytest.approx([1.0, 1.0, 2 / 3, 2 / 3, 1 / 3])
    prompts = DigitTaskPrompts(OmegaConf.create({"task": "reverse", "min_digits": 2, "max_digits": 4}), tokenizer, seed=0)
    result = env.step([prompts.task_prompt([1, 2])] * 2, [answer, no_eos])
    assert result.rewards.tolist() == pytest.approx([1.0, 2 / 3])
    assert env.metrics(result) == pytest.approx({"reward": 5 / 6, "accuracy": 0.5})


def test_prompts_respect_the_digit_range_and_the_seed():
    prompts = DigitTaskPrompts(DIGITS_CFG, DigitTokenizer(), seed=1).next_prompts(200)
    digits = [prompt.answer for prompt in prompts]
    assert {len(prompt) for prompt in digits} == {2, 3, 4}
    assert all(0 <= digit <= 9 for prompt in digits for digit in prompt)
    assert digits == [prompt.answer for prompt in DigitTaskPrompts(DIGITS_CFG, DigitTokenizer(), seed=1).next_prompts(200)]
    assert digits != [prompt.answer for prompt in DigitTaskPrompts(DIGITS_CFG, DigitTokenizer(), seed=2).next_prompts(200)]


def test_prompt_order_resumes_from_its_state():
    source = DigitTaskPrompts(DIGITS_CFG, DigitTokenizer(), seed=3)
    source.next_prompts(7)
    state = source.state_dict()
    expected = [prompt.answer for prompt in source.next_prompts(5)]
    resumed = DigitTaskPrompts(DIGITS_CFG, DigitTokenizer(), seed=3)
    resumed.load_state_dict(state)
    assert [prompt.answer for prompt in resumed.next_prompts(5)] == expected


def test_prompts_carry_their_correct_answer_as_demonstration():
    tokenizer = DigitTokenizer()
    prompt = DigitTaskPrompts(DIGITS_CFG, tokenizer, seed=0).task_prompt([3, 1, 2])
    assert prompt.prompt_ids == [tokenizer.bos_id, 7, 5, 6, tokenizer.sep_id]
    assert prompt.demonstration_ids == [5, 6, 7, tokenizer.eos_id]  # sorted: 1 2 3, then </s>


def test_training_prompts_never_include_a_validation_prompt():
    """Without the exclusion about 128 / 11100 of 20000 draws (about 230) would be held out."""
    from nemo_rl_mtp.config.load import load_config

    env_cfg = load_config().env
    source = DigitTaskPrompts(env_cfg, DigitTokenizer(), seed=0, num_validation_prompts=128)
    held_out = {tuple(prompt.answer) for prompt in source.validation_prompts}
    assert len(held_out) == 128
    assert DigitTaskPrompts(env_cfg, DigitTokenizer(), seed=5, num_validation_prompts=128).validation_digits == source.validation_digits  # fixed
    drawn = source.sample_digits(20_000, torch.Generator().manual_seed(0))
    assert len(drawn) == 20_000 and not held_out & {tuple(prompt) for prompt in drawn}
    unfiltered = DigitTaskPrompts(env_cfg, DigitTokenizer(), seed=0).sample_digits(20_000, torch.Generator().manual_seed(0))
    assert len(held_out & {tuple(prompt) for prompt in unfiltered}) > 50  # control: the draws do hit it
