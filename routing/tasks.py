from celery import shared_task

from routing import services


@shared_task
def deployments_check_health():
    return len(services.deployments_check_health())


@shared_task
def pool_changes_trim():
    from routing import changes

    return changes.trim()


@shared_task
def served_figures_refresh():
    from routing import served

    return served.served_figures_refresh()


@shared_task
def checks_run():
    from routing import checks

    return checks.checks_run()
