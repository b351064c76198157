import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from routing.asgi import Application  # noqa: E402  (needs the apps loaded above)

# /v1 straight to its async views; everything else through Django's handler.
application = Application(django_application)
