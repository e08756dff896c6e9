"""The REST API under ``/api/`` (DRF): datasets, models, backends and training jobs."""
