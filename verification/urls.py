from django.urls import path

from verification import views

app_name = "verification"
urlpatterns = [
    path("nodes/<int:node_id>/reverify/", views.reverify, name="reverify"),
]
