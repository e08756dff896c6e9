"""A real OpenSSH server for tests: Debian's ``sshd`` on 127.0.0.1, every file in a temporary directory.

:func:`sshd_server` generates a host key and a client key pair with ``ssh-keygen``, writes an
``sshd_config`` that listens on a free loopback port and accepts only that client key (for the user
running the tests; root logs in with a key only), starts ``/usr/sbin/sshd -D -e -f <config>`` and
yields an :class:`SshServer`; at the end it stops sshd by its PID (and the per-connection sshd
processes it forked, by theirs)::

    with sshd_server(tmp_path) as server:
        transport = SshTransport("127.0.0.1", port=server.port, user=server.user,
                                 private_key=server.client_key, host_key=server.host_key_line)

sshd needs its privilege separation directory ``/run/sshd`` when started as root; Debian's service
unit makes it at boot (``RuntimeDirectory=sshd``), so without systemd the kit makes it (mode 0755,
owned by root, empty) when it is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class SshServer:
    """A running sshd: where it listens, who may log in and with which key."""

    port: int
    user: str  # the account the client key logs in as (the test's own user)
    client_key: str  # the accepted client private key (OpenSSH format, Ed25519), as text
    client_public_key: str  # its authorized_keys line
    host_key_line: str  # the server's Ed25519 host key as ssh-keyscan prints it: "127.0.0.1 ssh-ed25519 AAAA…"
    host_keys: dict[str, str]  # key type ("ed25519", "rsa") -> public key line "ssh-… AAAA… comment"
    directory: Path  # where its config, keys, pid file and log are
    pid: int
    log_path: Path

    def authorize(self, public_key_line: str) -> None:
        """Accept one more client key (sshd reads AuthorizedKeysFile at each login)."""
        with open(self.directory / "authorized_keys", "a") as fh:
            fh.write(public_key_line.strip() + "\n")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def connection_pids(self) -> list[int]:
        """The sshd processes serving a connection now (the children of the listening sshd)."""
        try:
            return [int(p) for p in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()]
        except OSError:  # a kernel without CONFIG_PROC_CHILDREN: find them by their parent
            pass
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == self.pid and fields[0] != "Z":
                children.append(int(stat.parent.name))
        return children

    def drop_connections(self) -> None:
        """End every open connection from the server's side, as a login node's crash or a firewall's
        reset would: SIGKILL to each connection's sshd (SIGTERM can be lost: sshd 9.2's session loop
        checks for it only after poll(2) returns), then wait until they are gone."""
        pids = self.connection_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while set(pids) & set(self.connection_pids()):
            if time.monotonic() > deadline:
                pytest.fail(f"sshd connection processes {pids} did not end; log:\n{self.log()[-2000:]}")
            time.sleep(0.05)


def keygen(path: Path, key_type: str = "ed25519", *, comment: str = "trainboard-test",
           fmt: str | None = None) -> tuple[str, str]:
    """A new key pair at ``path`` (no passphrase): ``(private key text, public key line)``.
    ``fmt``: ssh-keygen's ``-m`` (``PEM``, ``PKCS8``) for a PEM private key instead of OpenSSH's."""
    argv = [SSH_KEYGEN, "-q", "-t", key_type, "-N", "", "-C", comment, "-f", str(path)]
    if key_type == "rsa":
        argv += ["-b", "2048"]
    if fmt:
        argv += ["-m", fmt]
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return path.read_text(), Path(f"{path}.pub").read_text().strip()


@contextlib.contextmanager
def sshd_server(directory: Path) -> Iterator[SshServer]:
    """Start a throw-away sshd on 127.0.0.1 (its files under ``directory``); stop it by PID at the end."""
    for needed in (SSHD, SSH_KEYGEN, SFTP_SERVER):
        if not os.path.exists(needed):
            pytest.fail(f"{needed} is missing: install Debian's openssh-server (scripts/system-deps.sh).")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    host_keys = {}
    for key_type in ("ed25519", "rsa"):
        _, public = keygen(directory / f"host_{key_type}", key_type, comment="")
        host_keys[key_type] = public
    client_key, client_public = keygen(directory / "client_ed25519")
    (directory / "authorized_keys").write_text(client_public + "\n")
    os.chmod(directory / "authorized_keys", 0o600)
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    port = free_port()
    pid_file = directory / "sshd.pid"
    config = directory / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress 127.0.0.1:{port}",
        f"HostKey {directory / 'host_ed25519'}",
        f"HostKey {directory / 'host_rsa'}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",  # the temp directory's owner and modes are the test's, not a home's
        "PermitUserEnvironment no",
        "AllowTcpForwarding no",
        "X11Forwarding no",
        "PrintMotd no",
        "UseDNS no",
        "MaxStartups 50",
        "LogLevel VERBOSE",
        f"Subsystem sftp {SFTP_SERVER}",
        "",
    ]))
    log_path = directory / "sshd.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = SshServer(port=port, user=getpass.getuser(), client_key=client_key, client_public_key=client_public,
                       host_key_line=f"127.0.0.1 {host_keys['ed25519']}", host_keys=host_keys,
                       directory=directory, pid=proc.pid, log_path=log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.settimeout(5)
                    if s.recv(64).startswith(b"SSH-2.0-"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd did not listen on 127.0.0.1:{port}:\n{server.log()[-3000:]}")
            time.sleep(0.05)
        yield server
    finally:
        children = server.connection_pids()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in children:  # connections left open by a failed test outlive the listener otherwise
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
