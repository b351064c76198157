"""Thin Celery tasks. The pipeline: run_start, then the agent's probes (answered over HTTP),
then the chain load test -> evaluate -> publish, started by `verification_advance` as soon as
a run's probes are in (beat, every 5 s). Every step is idempotent and acks late."""

from celery import chain, shared_task

from verification import services


@shared_task(acks_late=True)
def verification_start(node_id: int, trigger: str) -> int:
    return services.run_start(node_id=node_id, trigger=trigger).pk


@shared_task(acks_late=True)
def verification_load_test(run_id: int) -> bool:
    return services.run_load_test(run_id=run_id)


@shared_task(acks_late=True)
def verification_evaluate(run_id: int) -> bool:
    return services.run_evaluate(run_id=run_id)


@shared_task(acks_late=True)
def verification_publish(run_id: int) -> bool:
    return services.run_publish(run_id=run_id)


def pipeline(run_id: int):
    return chain(verification_load_test.si(run_id), verification_evaluate.si(run_id),
                 verification_publish.si(run_id))


@shared_task(acks_late=True)
def verification_advance() -> int:
    ready = services.runs_ready_for_load_test()
    for run_id in ready:
        pipeline(run_id).apply_async()
    return len(ready)


@shared_task(acks_late=True)
def verification_sweep() -> int:
    return len(services.runs_time_out_stale())


@shared_task(acks_late=True)
def verification_weekly() -> int:
    return services.runs_start_weekly()
