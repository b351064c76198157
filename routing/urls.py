from django.urls import path, re_path

from routing import views

urlpatterns = [
    path("v1/models", views.models, name="v1-models"),
    path("v1/chat/completions", views.chat_completions, name="v1-chat-completions"),
    path("v1/completions", views.completions, name="v1-completions"),
    re_path(r"^v1/(?P<rest>.*)$", views.not_found),
    path("metrics", views.prometheus, name="metrics"),
]
