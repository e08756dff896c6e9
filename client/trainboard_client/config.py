"""Where the client keeps its login: ``$XDG_CONFIG_HOME/trainboard/credentials.json`` (else
``~/.config/trainboard/``), mode 0600 in a 0700 directory. ``TRAINBOARD_URL`` and
``TRAINBOARD_TOKEN`` override what is stored (a CI job needs no file)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str
    username: str = ""
    source: str = ""  # where they came from: the file's path, or the environment


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    return root / "trainboard"


def credentials_path() -> Path:
    return config_dir() / "credentials.json"


def save(url: str, token: str, username: str = "") -> Path:
    """Store the login, readable by this user only (0600; the directory 0700). Returns the file."""
    directory = config_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    path = credentials_path()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"url": url.rstrip("/"), "token": token, "username": username}, handle)
    os.chmod(tmp, 0o600)  # O_CREAT's mode only applies to a new file
    os.replace(tmp, path)
    return path


def stored() -> Credentials | None:
    path = credentials_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("url") or not data.get("token"):
        return None
    return Credentials(url=str(data["url"]), token=str(data["token"]), username=str(data.get("username") or ""),
                       source=str(path))


def load() -> Credentials | None:
    """The login in effect: the environment's ``TRAINBOARD_URL`` / ``TRAINBOARD_TOKEN`` over the file's."""
    saved = stored()
    url = os.environ.get("TRAINBOARD_URL") or (saved.url if saved else "")
    token = os.environ.get("TRAINBOARD_TOKEN") or (saved.token if saved else "")
    if not url or not token:
        return None
    from_env = [name for name in ("TRAINBOARD_URL", "TRAINBOARD_TOKEN") if os.environ.get(name)]
    source = " and ".join(from_env) if from_env else (saved.source if saved else "")
    if from_env and saved and len(from_env) == 1:
        source += f" (the rest from {saved.source})"
    username = saved.username if saved and saved.url == url.rstrip("/") and saved.token == token else ""
    return Credentials(url=url.rstrip("/"), token=token, username=username, source=source)


def remove() -> bool:
    """Forget the stored login; False when there was none."""
    try:
        credentials_path().unlink()
    except FileNotFoundError:
        return False
    return True
