from django.urls import path, re_path

from routing import views

urlpatterns = [
    *(path(route, view, name=route.replace("/", "-")) for route, view in views.V1.items()),
    path("v1/models/<path:model_id>", views.model, name="v1-model"),
    re_path(r"^v1(?:/(?P<rest>.*))?$", views.not_found),
    path("metrics", views.prometheus, name="metrics"),
    path("staff/pool/", views.pool_page, name="staff-pool"),
    path("models/", views.models_page, name="models-page"),
    path("developers/", views.developers, name="developers"),
    path("activity/", views.activity, name="activity"),
    path("activity.csv", views.activity_csv, name="activity-csv"),
]
