from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class AccountsConfig(AppConfig):
    name = "accounts"
    default = True

    def ready(self):
        from accounts import receivers  # noqa: F401  (connects allauth's signals)


class AdminConfig(admin_apps.AdminConfig):
    default = False
    default_site = "accounts.admin_site.AdminSite"
