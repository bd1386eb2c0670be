"""How the suite's files are shared between pytest-xdist's workers (``pytest -n 2``): whole
files, the longest first, each worker taking the next file only when its current one is on its
last test.

Most of the suite's time is a few modules that start GRPO runs, each keeping about one core busy
(docs/testing-and-releases.md); on two cores, two of them side by side take about the time of
one. xdist's own file scheduling orders files by their number of tests and hands a worker its
next file while it still has two tests to run, which queues a long module behind another on one
worker while the other runs out of work. Longest first, taken when free, is the classic list
schedule that finishes within a third of the longest module of the best split.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

# The modules that take longest (measured, docs/testing-and-releases.md), longest first; the
# other files follow in collection order.
LONGEST_FIRST = (
    "tests/functional/test_release_matrix.py",
    "tests/functional/test_fault_injection.py",
    "tests/functional/test_grpo.py",
    "tests/functional/test_imported_models.py",
    "tests/functional/test_serving.py",
    "tests/functional/test_busy_start.py",
    "tests/functional/test_ray_cluster_join.py",
    "tests/functional/test_release_grpo.py",
    "tests/functional/test_grpo_learns.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: LONGEST_FIRST's files first, in its order; the rest as they were."""
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    order = {id(item): position for position, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::", 1)[0], len(rank)), order[id(item)]))


class LongestFirstFileScheduling(LoadFileScheduling):
    """Whole files in collection order (``longest_first``), the next one to a worker when its
    current file is down to its last test (a worker must always hold one test it has not run)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
