from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin

from accounts.models import LoginDevice, PersonalToken, User


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ("email",)
    list_display = ("email", "is_staff", "is_active", "date_joined")
    search_fields = ("email",)
    fieldsets = (
        (None, {"fields": ("email", "password")}),
        ("Names", {"fields": ("first_name", "last_name")}),
        ("Permissions", {"fields": ("is_active", "is_staff", "is_superuser", "groups",
                                    "user_permissions")}),
        ("Dates", {"fields": ("last_login", "date_joined")}),
    )
    add_fieldsets = ((None, {"classes": ("wide",),
                             "fields": ("email", "password1", "password2")}),)


@admin.register(PersonalToken)
class PersonalTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "prefix", "created_at", "last_used_at", "revoked_at")
    search_fields = ("user__email", "name", "prefix")
    readonly_fields = ("prefix", "digest", "created_at", "last_used_at")


@admin.register(LoginDevice)
class LoginDeviceAdmin(admin.ModelAdmin):
    """Written by log-ins only: operators read it when a holder asks about a log-in."""

    list_display = ("user", "user_agent", "ip", "first_seen_at", "last_seen_at")
    search_fields = ("user__email", "user_agent")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
