"""Run the Celery beat schedule in this process, for setups with no broker (the demo).

Production runs `celery beat` with the same schedule (config/celery.py); this command reads
that schedule rather than keeping a second one, and runs each entry in its own lane
(config/schedule.py) so that a long task never holds up the others.
"""

import signal
import threading

from django.core.management.base import BaseCommand
from django.db import connections

from config.celery import app
from config.schedule import Entry, Schedule


class Command(BaseCommand):
    help = "Run the periodic tasks of config/celery.py in-process (no broker needed)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Run every task once and exit.")
        parser.add_argument("--for", type=float, dest="duration", metavar="SECONDS",
                            help="Stop after SECONDS (default: run until Ctrl-C or SIGTERM).")

    def handle(self, *args, once=False, duration=None, **options):
        app.loader.import_default_modules()  # register the apps' tasks, as a worker would
        entries = [Entry(name, float(entry["schedule"]), _runner(entry["task"]))
                   for name, entry in app.conf.beat_schedule.items()]
        # Each lane is a thread with its own database connection: give it back after each run.
        schedule = Schedule(entries, report=lambda name, exc: self.stderr.write(f"{name}: {exc!r}"),
                            after_run=connections.close_all)
        if once:
            schedule.run_once()
            return
        self.stdout.write(f"Running {len(entries)} periodic tasks in-process, each on its own "
                          "cadence.")
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
        schedule.start()
        try:
            stop.wait(duration)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            schedule.stop()


def _runner(task_name: str):
    return lambda: app.tasks[task_name].apply()  # here, now: no broker involved
