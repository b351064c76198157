from django.urls import include, path

from accounts import views

app_name = "accounts"
urlpatterns = [
    path("", views.settings_page, name="settings"),
    path("logout-everywhere/", views.logout_everywhere, name="logout_everywhere"),
    path("tokens/", views.tokens, name="tokens"),
    path("tokens/<int:token_id>/revoke/", views.token_revoke, name="token_revoke"),
]

# allauth's pages (log-in, sign-up, email, password, two-factor, sessions) under the same
# prefix, with their own URL names (account_login, mfa_index, usersessions_list, ...).
allauth_urlpatterns = [path("", include("allauth.urls"))]
