from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Training jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Every process that loads the app (web, Celery worker, manage.py) writes no stored secret and
        # no credential an SDK or a provider puts in a log line (cloud_adapters/redaction.py).
        from cloud_adapters.redaction import install_log_redaction

        install_log_redaction()
        # A trial's job that ends tells its sweep (jobs.sweeps connects the receiver at import).
        import jobs.sweeps  # noqa: F401
        # Connects the job_state_changed receiver that turns job events into emails and webhook deliveries.
        from jobs import notifications  # noqa: F401
