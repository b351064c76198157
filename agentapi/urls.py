from django.urls import path

from agentapi import views

urlpatterns = [
    path("enroll/", views.AgentEnroll.as_view(), name="api-agent-enroll"),
    path("heartbeat/", views.AgentHeartbeat.as_view(), name="api-agent-heartbeat"),
    path("jobs/<int:job_id>/result/", views.AgentJobResult.as_view(),
         name="api-agent-job-result"),
]
