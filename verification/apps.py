from django.apps import AppConfig


class VerificationConfig(AppConfig):
    name = "verification"

    def ready(self):
        from verification import signals  # noqa: F401  (connects the marketplace's signals)
