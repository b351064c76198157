"""Run the Celery beat schedule in this process, for setups with no broker (the demo).

Production runs `celery beat` with the same schedule (config/celery.py); this command reads
that schedule rather than keeping a second one.
"""

import time

from django.core.management.base import BaseCommand

from config.celery import app


class Command(BaseCommand):
    help = "Run the periodic tasks of config/celery.py in-process (no broker needed)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Run every task once and exit.")

    def handle(self, *args, once=False, **options):
        app.loader.import_default_modules()  # register the apps' tasks, as a worker would
        entries = {name: (entry["task"], float(entry["schedule"]))
                   for name, entry in app.conf.beat_schedule.items()}
        due = dict.fromkeys(entries, 0.0)
        self.stdout.write(f"Running {len(entries)} periodic tasks in-process.")
        while True:
            now = time.monotonic()
            for name, (task, every) in entries.items():
                if now >= due[name]:
                    try:
                        app.tasks[task].apply()  # here, now: no broker involved
                    except Exception as exc:  # keep the schedule alive; report and go on
                        self.stderr.write(f"{name}: {exc!r}")
                    due[name] = now + every
            if once:
                return
            time.sleep(max(0.2, min(due.values()) - time.monotonic()))
