from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"

    def ready(self):
        from routing import signals  # noqa: F401  (connects the marketplace's signals)
