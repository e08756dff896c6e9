"""gunicorn's settings hooks for Trainboard's web server (``gunicorn -c python:webapp.gunicorn_conf``).

The master process, before it forks its workers, is made not dumpable, so a job running user code as
the same OS user on this machine cannot read the web server's environment (its secrets) through
``/proc`` (webapp/hardening.py). The workers inherit the flag.
"""

from webapp.hardening import make_undumpable


def on_starting(server) -> None:  # gunicorn's server hook: the master, once, before the workers
    make_undumpable()
