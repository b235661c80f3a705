from django.urls import path
from orders import views

urlpatterns = [
    path("orders/", views.place_order),
    path("jobs/", views.enqueue_job),
]
