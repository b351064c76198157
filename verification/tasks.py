"""Thin Celery tasks. The pipeline: run_start, then the agent's probes (answered over HTTP),
then the chain load test -> evaluate -> publish, started by `verification_advance` as soon as
a run's probes are in (beat, every 5 s). Every step is idempotent and acks late; a step whose
worker died is taken up again by its redelivered task or by `verification_sweep` (every 15 s)."""

from celery import chain, shared_task
from celery.exceptions import Ignore

from verification import services

Status = services.Status


def _step(task, service, run_id: int, step: str) -> bool:
    """Run one step. When another worker holds the run in this step (or held it and died, not
    long enough ago to tell), try again once it would be stale; when the run has moved on, stop
    here, and so does the rest of this chain (the next step is someone else's to run)."""
    if service(run_id=run_id):
        return True
    if services.run_status(run_id) == step and task.request.retries < task.max_retries:
        raise task.retry(countdown=services.STEP_STALE.total_seconds() + 5)
    raise Ignore()


@shared_task(bind=True, acks_late=True, max_retries=3)
def verification_load_test(self, run_id: int) -> bool:
    return _step(self, services.run_load_test, run_id, Status.LOAD_TESTING)


@shared_task(bind=True, acks_late=True, max_retries=3)
def verification_evaluate(self, run_id: int) -> bool:
    return _step(self, services.run_evaluate, run_id, Status.EVALUATING)


@shared_task(bind=True, acks_late=True, max_retries=0)
def verification_publish(self, run_id: int) -> bool:
    return _step(self, services.run_publish, run_id, Status.EVALUATING)


def pipeline(run_id: int, step: str = services.Status.LOAD_TESTING):
    """The chain from `step` on: a run left in evaluation skips its load test."""
    steps = [verification_evaluate.si(run_id), verification_publish.si(run_id)]
    if step != services.Status.EVALUATING:
        steps.insert(0, verification_load_test.si(run_id))
    return chain(*steps)


@shared_task(acks_late=True)
def verification_advance() -> int:
    ready = services.runs_ready_for_load_test()
    for run_id in ready:
        pipeline(run_id).apply_async()
    return len(ready)


@shared_task(acks_late=True)
def verification_sweep() -> int:
    resumed = services.runs_resume_stale()
    for run_id, step in resumed:
        pipeline(run_id, step).apply_async()
    for run_id, step in services.runs_requeue_waiting():
        if step == "evaluate":
            pipeline(run_id, services.Status.EVALUATING).apply_async()
        else:
            verification_publish.delay(run_id)
    return (len(resumed) + len(services.runs_time_out_stale())
            + services.served_drifts_close_orphaned())


@shared_task(acks_late=True)
def verification_weekly() -> int:
    return services.runs_start_weekly()
