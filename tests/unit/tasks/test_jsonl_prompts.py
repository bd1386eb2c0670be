"""Prompts from JSONL files through the real tiny tokenizer: a seeded, resumable order, the chat
template, overlong prompts skipped or truncated and counted, and one-line errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_rl_mtp.tasks.jsonl_prompts import JsonlPrompts
from nemo_rl_mtp.tasks.tokenizer import TextTokenizer
from nemo_rl_mtp.config.load import ConfigError

from scripts.tiny_mimo_checkpoint import build_tokenizer  # noqa: E402

HF_TOKENIZER = build_tokenizer()


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records))
    return str(path)


@pytest.fixture
def files(tmp_path) -> tuple[str, str]:
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"What is {n} + 1?", "answer": str(n + 1), "id": n} for n in range(10)])
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": f"What is {n} - 1?", "answer": n - 1} for n in range(4)])
    return train, val


def source(train: str, val: str, seed: int = 0, chat: bool = True, overlong: str = "skip", max_prompt_tokens: int = 64, **keys):
    data_cfg = OmegaConf.create(
        {"train_data_path": train, "val_data_path": val, "prompt_key": "prompt", "answer_key": "answer",
         "apply_chat_template": chat, "overlong_prompts": overlong, **keys}
    )  # fmt: skip
    tokenizer = TextTokenizer(HF_TOKENIZER, apply_chat_template=chat)
    return JsonlPrompts(data_cfg, tokenizer, seed, 2, max_prompt_tokens, lambda answer: f"\\boxed{{{answer}}}")


def answers(prompts) -> list[str]:
    return [prompt.answer for prompt in prompts]


def test_each_epoch_is_a_seeded_shuffle_of_every_line(files):
    prompts = source(*files, seed=1)
    first, second = answers(prompts.next_prompts(10)), answers(prompts.next_prompts(10))
    assert sorted(first, key=int) == sorted(second, key=int) == [str(n) for n in range(1, 11)]
    assert first != second  # a fresh shuffle each epoch
    assert first == answers(source(*files, seed=1).next_prompts(10))
    assert first != answers(source(*files, seed=2).next_prompts(10))


def test_a_resumed_source_continues_the_same_order_across_epochs(files):
    prompts = source(*files, seed=3)
    prompts.next_prompts(7)
    state = prompts.state_dict()
    expected = answers(prompts.next_prompts(9))  # crosses into the second epoch
    resumed = source(*files, seed=3)
    resumed.load_state_dict(state)
    assert answers(resumed.next_prompts(9)) == expected


def test_prompts_go_through_the_chat_template_and_demonstrations_end_the_turn(files):
    prompt = source(*files).validation_prompts[0]
    assert HF_TOKENIZER.decode(prompt.prompt_ids) == "<|im_start|>user\nWhat is 0 - 1?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.answer == "-1"
    assert HF_TOKENIZER.decode(prompt.demonstration_ids) == "\\boxed{-1}<|im_end|>"
    plain = source(*files, chat=False).validation_prompts[0]
    assert HF_TOKENIZER.decode(plain.prompt_ids) == "What is 0 - 1?"


def test_overlong_prompts_are_skipped_or_truncated_and_counted(tmp_path, files):
    long_text = "What is " + " + ".join(["1"] * 30) + "?"
    train = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": long_text, "answer": "30"}])
    full = TextTokenizer(HF_TOKENIZER, True).prompt_ids(long_text)
    limit = len(TextTokenizer(HF_TOKENIZER, True).prompt_ids("What is 1 + 1?")) + 5
    assert len(full) > limit
    skipping = source(train, files[1], max_prompt_tokens=limit)
    assert answers(skipping.next_prompts(4)) == ["2"] * 4
    lines_read = skipping.epoch * 2 + skipping.position  # every line read was used or skipped
    assert skipping.counters()["data/skipped_prompts"] == lines_read - 4 >= 3
    assert skipping.counters()["data/truncated_prompts"] == 0
    truncating = source(train, files[1], overlong="truncate", max_prompt_tokens=limit)
    prompts = truncating.next_prompts(2)
    long_prompt = next(prompt for prompt in prompts if prompt.answer == "30")
    assert long_prompt.prompt_ids == full[-limit:]  # the end of the question and the assistant's opening kept
    assert truncating.counters()["data/truncated_prompts"] == 1


BAD_FILES = {
    "not_json": (['{"prompt": "a", "answer": "1"}', "{oops"], "line 2: not JSON"),
    "missing_field": ([{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}], "line 2: no 'prompt' field (data.prompt_key)"),
    "empty": ([], "no prompts in it (the file is empty)"),
    "prompt_not_text": ([{"prompt": 5, "answer": "1"}], "line 1: the 'prompt' field is not a non-empty string"),
    "answer_not_scalar": ([{"prompt": "a", "answer": [1]}], "line 1: the 'answer' field is not a string or a number"),
    "not_an_object": (["[1, 2]"], "line 1: not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_training_file_is_one_line_naming_the_key_and_line(tmp_path, files, case):
    records, expected = BAD_FILES[case]
    train = write_jsonl(tmp_path / f"{case}.jsonl", records) if records else str((tmp_path / "empty.jsonl").touch() or tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError) as error:
        source(train, files[1])
    message = str(error.value)
    assert message.startswith(f"data.train_data_path={train}") and expected in message and "\n" not in message


def test_missing_unreadable_and_too_small_files_are_one_line(tmp_path, files):
    cases = {
        "No such file or directory": lambda: source(str(tmp_path / "missing.jsonl"), files[1]),
        "Is a directory": lambda: source(str(tmp_path), files[1]),
        "fewer than grpo.val_num_prompts=2": lambda: source(files[0], write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "1"}])),
        "every prompt is longer than the 3 tokens": lambda: source(
            files[0], write_jsonl(tmp_path / "short.jsonl", [{"prompt": "1", "answer": "1"}] * 2), chat=False, max_prompt_tokens=3
        ).next_prompts(1),
        "0 usable prompts (4 longer than the 3 tokens": lambda: source(*files, chat=False, max_prompt_tokens=3),
    }
    for expected, make in cases.items():
        with pytest.raises(ConfigError) as error:
            make()
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_file_checked_at_preflight_is_not_read_again_unless_it_changed(tmp_path):
    """The run's preflight checks the data files the prompt source then opens: the second open
    reuses the scan of an unchanged file (shown by swapping in a bad line of the same length under
    the same modification time, which only a new read would see) and reads a changed one again."""
    import os

    from nemo_rl_mtp.tasks.jsonl_prompts import JsonlFile

    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"prompt": "What is 1 + 1?", "answer": "2"}])
    checked = JsonlFile(str(path), "data.train_data_path", "prompt", "answer")
    stat = path.stat()
    path.write_text(path.read_text().replace('"answer"', '"answeX"'))  # same size, no answer field
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert JsonlFile(str(path), "data.train_data_path", "prompt", "answer").offsets == checked.offsets
    write_jsonl(path, [{"prompt": "What is 1 + 1?", "answeX": "2"}, {"prompt": "What is 2 + 2?", "answer": "4"}])
    with pytest.raises(ConfigError, match=r"line 1: no 'answer' field"):
        JsonlFile(str(path), "data.train_data_path", "prompt", "answer")
