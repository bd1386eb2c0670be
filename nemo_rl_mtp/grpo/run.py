"""Where a run's checkpoints live, which one is the latest, and how one becomes complete.

A checkpoint is a directory ``step_<NNNNNN>`` (the number of GRPO steps done). It is written as
``step_<NNNNNN>.partial`` and renamed only once every part is on disk, so a run killed during a
save leaves a ``.partial`` directory that is never taken for a checkpoint (and is removed by the
next save). The latest checkpoint is the complete one with the most steps.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

_COMPLETE = re.compile(r"^step_(\d{6,})$")
PARTIAL_SUFFIX = ".partial"


class CheckpointDirectory:
    def __init__(self, root: Path, keep_last: int):
        self.root = root
        self.keep_last = keep_last

    def complete(self) -> list[tuple[int, Path]]:
        """(steps done, path) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), path) for path in self.root.iterdir() if (m := _COMPLETE.match(path.name))]
        return sorted(found)

    def latest(self) -> Optional[Path]:
        complete = self.complete()
        return complete[-1][1] if complete else None

    def save(self, steps_done: int, write: Callable[[Path], None]) -> Path:
        """``write(directory)`` fills a partial directory; it becomes the latest checkpoint when
        ``write`` returns, and checkpoints beyond ``keep_last`` are removed, oldest first."""
        for stale in self.root.glob(f"*{PARTIAL_SUFFIX}") if self.root.is_dir() else []:
            shutil.rmtree(stale)
        final = self.root / f"step_{steps_done:06d}"
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        partial.mkdir(parents=True)
        write(partial)
        if final.exists():  # the same step saved again (a resumed run's final save)
            shutil.rmtree(final)
        os.rename(partial, final)
        self._prune()
        return final

    def _prune(self) -> None:
        complete = self.complete()
        if self.keep_last > 0:
            for _, path in complete[: -self.keep_last]:
                shutil.rmtree(path)
