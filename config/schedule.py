"""Periodic tasks run in this process, each on its own cadence (`manage.py run_schedule`).

Each entry has a lane: a thread that runs it, then sleeps until its next tick. A task that runs
long (a verification load test) holds up only its own lane: the others keep their cadence (a
silent node is still marked offline within seconds, rentals are still charged every 30 s), and
no task ever runs twice at once. Ticks a task overran are skipped, not run back to back.
"""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    name: str
    every_s: float
    run: Callable[[], object]


def next_tick(first: float, every_s: float, now: float) -> float:
    """The first tick first + k * every_s (k >= 1) that is after now."""
    return first + every_s * max(1, math.floor((now - first) / every_s) + 1)


class Schedule:
    """`start()` the lanes, `stop()` them; `report(name, exc)` hears of each task that raised
    (the lane goes on), `after_run()` runs in a lane after each of its tasks (e.g. to close the
    lane's database connections)."""

    def __init__(self, entries: list[Entry], *, report: Callable[[str, Exception], None],
                 after_run: Callable[[], None] = lambda: None, clock=time.monotonic):
        self.entries = entries
        self.report = report
        self.after_run = after_run
        self.clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def run_once(self) -> None:
        """Every entry once, one after the other, in this thread."""
        for entry in self.entries:
            self._run(entry)

    def start(self) -> None:
        for entry in self.entries:
            thread = threading.Thread(target=self._lane, args=(entry,), daemon=True,
                                      name=f"schedule:{entry.name}")
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the lanes to stop and wait up to `timeout` for the tasks in hand; a task still
        running after that dies with the process (its transaction rolls back)."""
        self._stop.set()
        deadline = self.clock() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - self.clock()))

    def _lane(self, entry: Entry) -> None:
        first = self.clock()
        due = first
        while not self._stop.is_set():
            self._run(entry)
            self.after_run()
            due = next_tick(first, entry.every_s, max(due, self.clock()))
            if self._stop.wait(max(0.0, due - self.clock())):
                return

    def _run(self, entry: Entry) -> None:
        try:
            entry.run()
        except Exception as exc:  # keep the schedule alive; report and go on
            self.report(entry.name, exc)
