"""Trainboard's client: the ``trainboard`` command and a Python SDK over the server's REST API.

::

    from trainboard_client import Client

    tb = Client("http://127.0.0.1:8000", token)
    job = tb.create_job(dataset="digits", model_spec="digits-cnn", backend="local", epochs=3)
    for line in tb.follow_logs(job["id"]):
        print(line)
    print(tb.job(job["id"])["state"])

Nothing here imports the server (an import contract in the repository's pyproject.toml keeps it so).
"""

from trainboard_client.api import ApiError, AuthError, Client, TrainboardError, Unreachable

__all__ = ["ApiError", "AuthError", "Client", "TrainboardError", "Unreachable"]
