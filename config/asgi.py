import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from agentapi.asgi import HeartbeatFront  # noqa: E402  (needs the apps loaded above)
from routing.asgi import Application  # noqa: E402

# /v1 straight to its async views; a repeated agent heartbeat answered from Redis; everything
# else through Django's handler.
application = HeartbeatFront(Application(django_application))
