"""The client (client/, ``trainboard``) against a real server: pytest-django's ``live_server`` on
the test's PostgreSQL database, the CLI as its user runs it (the venv's ``trainboard`` script in a
subprocess), with a configuration directory of its own (``XDG_CONFIG_HOME``) and none of this
process's Django settings in its environment."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TRAINBOARD = Path(sys.executable).with_name("trainboard")


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def both(self) -> str:
        return self.out + self.err


class Cli:
    """Runs ``trainboard ARGS`` as a user would: ``home`` holds its config directory."""

    def __init__(self, url: str, home: Path) -> None:
        self.url = url
        self.home = home
        self.config_dir = home / "config"
        self.env: dict[str, str] = {}

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        assert TRAINBOARD.exists(), f"{TRAINBOARD} is missing: install requirements-dev.txt (make dev-venv)"
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("DJANGO", "DATABASE", "REDIS", "TRAINBOARD", "PYTEST", "CELERY"))}
        return {**base, "XDG_CONFIG_HOME": str(self.config_dir), "HOME": str(self.home), "TRAINBOARD_RETRIES": "1",
                **self.env, **(env or {})}

    def __call__(self, *args: str, input: str | None = None, cwd: Path | None = None, timeout: float = 60,
                 env: dict[str, str] | None = None) -> Result:
        done = subprocess.run([str(TRAINBOARD), *args], input=input, capture_output=True, text=True,
                              cwd=cwd or self.home, env=self.environment(env), timeout=timeout)
        return Result(done.returncode, done.stdout, done.stderr)

    def start(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``trainboard ARGS`` started, not waited for (stdin closed, stdout and stderr piped as text)."""
        return subprocess.Popen([str(TRAINBOARD), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd or self.home, env=self.environment(env))

    def login(self, username: str = "alice", password: str = "pw-alice-123") -> Result:
        result = self("login", self.url, "--username", username, "--password-stdin", input=password + "\n")
        assert result.code == 0, result.both
        return result


@pytest.fixture
def cli(live_server, tmp_path) -> Cli:
    home = tmp_path / "home"
    home.mkdir()
    return Cli(live_server.url, home)


@pytest.fixture
def logged_in(cli, user) -> Cli:
    """``cli`` logged in as the ``user`` fixture (alice) with username and password."""
    cli.login()
    return cli
