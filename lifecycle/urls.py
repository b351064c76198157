from django.urls import path

from lifecycle import views

app_name = "lifecycle"
urlpatterns = [
    path("data.json", views.data_download, name="data_download"),
    path("close/", views.close, name="close"),
]
