"""The cloud adapter tests' provider stand-ins (tests/cloud_adapters/<cloud>/standin.py: sagemaker,
vertex, azureml) for tests in other folders, and the loopback servers that go with them: a free port,
gcp-storage-emulator."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
from pathlib import Path
from typing import Iterator

ADAPTER_TESTS = Path(__file__).resolve().parent / "cloud_adapters"


def standin(cloud: str):
    """tests/cloud_adapters/``cloud``/standin.py as the module ``<cloud>_standin`` (every cloud's
    file is standin.py: each gets a name of its own), loaded once."""
    name = f"{cloud}_standin"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ADAPTER_TESTS / cloud / "standin.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gcs_emulator(bucket: str = "stage") -> Iterator[str]:
    """gcp-storage-emulator in memory on a free loopback port, with the bucket ``bucket``; its URL."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
