"""The Celery application. Broker: Redis when ``REDIS_URL`` is set, else kombu's filesystem transport
(no server needed) under ``TRAINBOARD_VAR_DIR/broker``. Configuration lives in settings (``CELERY_*``)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("trainboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
