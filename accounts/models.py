from django.contrib.auth.models import AbstractUser, BaseUserManager
from django.db import models
from django.utils.crypto import salted_hmac


class UserManager(BaseUserManager):
    use_in_migrations = True

    def create_user(self, email, password=None, **extra):
        if not email:
            raise ValueError("An email address is required.")
        user = self.model(email=self.normalize_email(email).lower(), **extra)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def create_superuser(self, email, password=None, **extra):
        extra.setdefault("is_staff", True)
        extra.setdefault("is_superuser", True)
        return self.create_user(email, password, **extra)


class User(AbstractUser):
    """One person may rent, provide and consume: roles are what they do, not a flag."""

    username = None
    email = models.EmailField("email address", unique=True)

    USERNAME_FIELD = "email"
    REQUIRED_FIELDS: list[str] = []

    # Set when the holder closed the account: the person is anonymized, the ledger stays.
    closed_at = models.DateTimeField(null=True, blank=True)
    # Raised to end every session at once ("log out everywhere", two-factor turned on): it is
    # part of the hash each session is checked against, as the password is.
    session_generation = models.PositiveIntegerField(default=0)

    objects = UserManager()

    def __str__(self):
        return self.email

    def _get_session_auth_hash(self, secret=None):
        # Django checks every request's session against this hash (and its fallbacks); at
        # generation 0 it is Django's own, so sessions from before generations stay valid.
        if not self.session_generation:
            return super()._get_session_auth_hash(secret=secret)
        return salted_hmac("accounts.User.session_auth_hash",
                           f"{self.password}:{self.session_generation}", secret=secret,
                           algorithm="sha256").hexdigest()


class PersonalToken(models.Model):
    """A token for the REST API (`Authorization: Bearer rst_...`), stored as prefix + HMAC."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="personal_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=32, unique=True)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} (rst_{self.prefix}_…)"


class LoginDevice(models.Model):
    """A browser the user has logged in from, known by a random id in a long-lived cookie
    (stored here as its SHA-256). A log-in from a browser not on the list is emailed."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="login_devices")
    digest = models.CharField(max_length=64)
    user_agent = models.CharField(max_length=300, blank=True)
    ip = models.GenericIPAddressField(null=True, blank=True)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "digest"],
                                               name="login_device_once_per_user")]

    def __str__(self):
        return f"{self.user} on {self.user_agent[:60] or 'an unknown browser'}"
