"""Prompts from JSONL files (``data.train_data_path``, ``data.val_data_path``): one JSON object a
line, its prompt text and reference answer in the fields ``data.prompt_key``/``data.answer_key``.

Each file is checked line by line when the run starts (before any worker), so a bad line is one
error naming the file and line, not a crash hours in; after that only byte offsets are kept and
lines are read as they are needed. Training prompts come in a seeded order, a fresh shuffle each
epoch, and the order's position is part of a checkpoint, so a resumed run continues it. Prompts
too long for the model are skipped or truncated (``data.overlong_prompts``) and counted.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from nemo_rl_mtp.tasks.interfaces import PromptSource, TaskPrompt
from nemo_rl_mtp.config.load import ConfigError
from nemo_rl_mtp.metrics import DATA, EPOCH, SKIPPED_PROMPTS, TRUNCATED_PROMPTS, all_in_scope

logger = logging.getLogger(__name__)


# Successful scans by file version (path, size, modification time, fields): the run's preflight
# scans the files the prompt source then opens, and an unchanged file is not read again.
_SCANS: dict[tuple, tuple[list[int], list[int]]] = {}
_SCANS_KEPT = 8


class JsonlFile:
    """A JSONL file's records, checked once per version of the file, read by index."""

    def __init__(self, path: str, key: str, prompt_key: str, answer_key: str):
        self.path, self.key = Path(path), key
        self.prompt_key, self.answer_key = prompt_key, answer_key
        version = self._version()
        if version not in _SCANS:
            if len(_SCANS) >= _SCANS_KEPT:
                _SCANS.clear()
            _SCANS[version] = self._scan()
        self.offsets, self.line_numbers = _SCANS[version]

    def __len__(self) -> int:
        return len(self.offsets)

    def _version(self) -> tuple:
        try:
            stat = self.path.stat()
        except OSError as error:
            raise ConfigError(f"{self.key}={self.path}: cannot be read ({error.strerror or error})") from None
        return (str(self.path.resolve()), stat.st_size, stat.st_mtime_ns, self.prompt_key, self.answer_key)

    def _scan(self) -> tuple[list[int], list[int]]:
        offsets, line_numbers = [], []
        try:
            with self.path.open("rb") as file:
                offset = 0
                for line_number, line in enumerate(file, start=1):
                    if line.strip():
                        self._check(line, line_number)
                        offsets.append(offset)
                        line_numbers.append(line_number)
                    offset += len(line)
        except OSError as error:
            raise ConfigError(f"{self.key}={self.path}: cannot be read ({error.strerror or error})") from None
        if not offsets:
            raise ConfigError(f"{self.key}={self.path}: no prompts in it (the file is empty)")
        return offsets, line_numbers

    def _check(self, line: bytes, line_number: int) -> None:
        where = f"{self.key}={self.path}, line {line_number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ConfigError(f"{where}: not JSON ({error})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object")
        for field, key in ((self.prompt_key, "data.prompt_key"), (self.answer_key, "data.answer_key")):
            if field not in record:
                raise ConfigError(f"{where}: no {field!r} field ({key})")
        if not isinstance(record[self.prompt_key], str) or not record[self.prompt_key].strip():
            raise ConfigError(f"{where}: the {self.prompt_key!r} field is not a non-empty string")
        if not isinstance(record[self.answer_key], (str, int, float)) or isinstance(record[self.answer_key], bool):
            raise ConfigError(f"{where}: the {self.answer_key!r} field is not a string or a number")

    def records(self, indices: list[int]) -> list[tuple[int, dict]]:
        """``(line number, record)`` of each index."""
        with self.path.open("rb") as file:
            found = []
            for index in indices:
                file.seek(self.offsets[index])
                found.append((self.line_numbers[index], json.loads(file.readline())))
        return found


def check_data_files(data_cfg) -> None:
    """Each JSONL file ``data_cfg`` names, checked line by line as :class:`JsonlFile` does, at the
    run's preflight (before megatron-core is imported and the model opened): a bad line is refused
    in seconds. The prompt source opens the same files without reading them again (``_SCANS``),
    unless they changed in between."""
    for key in ("train_data_path", "val_data_path"):
        if data_cfg[key] is not None:
            JsonlFile(data_cfg[key], f"data.{key}", data_cfg.prompt_key, data_cfg.answer_key)


class JsonlPrompts(PromptSource):
    """Training prompts from ``train_path`` in a seeded order, validation prompts: the first
    ``num_validation_prompts`` usable lines of ``val_path``."""

    def __init__(
        self,
        data_cfg,
        tokenizer,
        seed: int,
        num_validation_prompts: int,
        max_prompt_tokens: int,
        demonstration: Callable[[str], Optional[str]],
    ):
        self.tokenizer = tokenizer
        self.prompt_key, self.answer_key = data_cfg.prompt_key, data_cfg.answer_key
        self.overlong = data_cfg.overlong_prompts
        self.max_prompt_tokens = max_prompt_tokens
        self.demonstration = demonstration
        self.seed = seed
        self.train = JsonlFile(data_cfg.train_data_path, "data.train_data_path", self.prompt_key, self.answer_key)
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)
        self._usable_this_epoch = False
        self.skipped = self.truncated = 0
        self.validation_prompts = self._validation_prompts(
            JsonlFile(data_cfg.val_data_path, "data.val_data_path", self.prompt_key, self.answer_key), num_validation_prompts
        )

    def _epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train), generator=generator).tolist()

    def next_prompts(self, num_prompts: int) -> list[TaskPrompt]:
        prompts = []
        while len(prompts) < num_prompts:
            (line_number, record), = self.train.records([self._order[self.position]])
            prompt = self._task_prompt(record, line_number, "data.train_data_path")
            if prompt is not None:
                prompts.append(prompt)
                self._usable_this_epoch = True
            self._advance()
        return prompts

    def _advance(self) -> None:
        self.position += 1
        if self.position < len(self.train):
            return
        if not self._usable_this_epoch:
            raise ConfigError(
                f"data.train_data_path={self.train.path}: every prompt is longer than the {self.max_prompt_tokens} "
                "tokens the model allows (policy.max_total_sequence_length - max_new_tokens)"
            )
        self.epoch, self.position, self._usable_this_epoch = self.epoch + 1, 0, False
        self._order = self._epoch_order(self.epoch)

    def _task_prompt(self, record: dict, line_number: int, key: str) -> Optional[TaskPrompt]:
        """The record as a prompt; None when it is too long and ``overlong_prompts: skip``."""
        prompt_ids = self.tokenizer.prompt_ids(record[self.prompt_key])
        if len(prompt_ids) > self.max_prompt_tokens:
            if self.overlong == "skip":
                self.skipped += 1
                if self.skipped == 1:
                    logger.warning(
                        "%s line %d: %d prompt tokens, more than the %d the model allows; skipped (data.overlong_prompts=skip; "
                        "counted as data/skipped_prompts)", key, line_number, len(prompt_ids), self.max_prompt_tokens,
                    )  # fmt: skip
                return None
            self.truncated += 1
            if self.truncated == 1:
                logger.warning(
                    "%s line %d: %d prompt tokens, more than the %d the model allows; its last %d kept "
                    "(data.overlong_prompts=truncate; counted as data/truncated_prompts)",
                    key, line_number, len(prompt_ids), self.max_prompt_tokens, self.max_prompt_tokens,
                )  # fmt: skip
            prompt_ids = prompt_ids[-self.max_prompt_tokens :]
        answer = str(record[self.answer_key])
        demonstration = self.demonstration(answer)
        return TaskPrompt(
            prompt_ids=prompt_ids,
            answer=answer,
            demonstration_ids=self.tokenizer.response_ids(demonstration) if demonstration is not None else None,
            metadata={"line": line_number},
        )

    def _validation_prompts(self, val: JsonlFile, num_prompts: int) -> list[TaskPrompt]:
        prompts, too_long = [], 0
        for line_number, record in val.records(list(range(len(val)))):
            prompt = self._task_prompt(record, line_number, "data.val_data_path")
            too_long += prompt is None
            if prompt is not None:
                prompts.append(prompt)
            if len(prompts) == num_prompts:
                return prompts
        raise ConfigError(
            f"data.val_data_path={val.path}: {len(prompts)} usable prompts ({too_long} longer than the {self.max_prompt_tokens} "
            f"tokens the model allows), fewer than grpo.val_num_prompts={num_prompts}"
        )

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "skipped": self.skipped, "truncated": self.truncated}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.skipped, self.truncated = state["skipped"], state["truncated"]
        self._order = self._epoch_order(self.epoch)
        self._usable_this_epoch = self.position > 0  # unknown mid-epoch: assume the epoch had one

    def counters(self) -> dict[str, float]:
        counts = {SKIPPED_PROMPTS: float(self.skipped), TRUNCATED_PROMPTS: float(self.truncated), EPOCH: float(self.epoch)}
        return all_in_scope(DATA, counts)
