"""The Slurm backend's way to a login node over SSH (paramiko): :class:`SshTransport`.

It keeps the :class:`cloud_adapters.slurm.transport.Transport` promises over one SSH connection per
transport object:

* commands: one SSH ``exec`` channel each; the command line is ``shlex.join(argv)`` (prefixed by
  ``env K=V …`` when ``env`` is given), because the SSH server hands the line to the remote user's
  login shell (RFC 4254 §6.5, "exec"). The user's shell must therefore be POSIX (sh, bash, dash,
  zsh, ksh): csh/tcsh and fish quote differently.
* files: SFTP (version 3, draft-ietf-secsh-filexfer-02, as OpenSSH's ``sftp-server`` speaks it). A write goes to a
  temporary name beside the target, gets its mode before any byte is written, and is renamed over the
  target with OpenSSH's ``posix-rename@openssh.com`` extension (atomic, replaces an existing file).

Trust: the server's host key must equal the one configured (a known_hosts line, as
``ssh-keyscan -t ed25519 <login host>`` prints it); nothing is ever learnt or accepted on first use.
The client key is parsed in memory from its text and never written to disk.

Errors (as :mod:`cloud_adapters.slurm.transport` states them for every transport):

* :class:`~cloud_adapters.base.CredentialsError` -- the host key differs from the configured one, the
  server refused the key, or the private key cannot be read (encrypted, malformed).
* :class:`~cloud_adapters.base.ProviderError` with ``transient=True`` -- the host does not resolve,
  refuses or times out the connection, the connection drops, or a command outlives its timeout.
* :class:`~cloud_adapters.base.InvalidSpec` -- a host key line or an argument that cannot be used
  (caught by the adapter's settings check before any connection).
"""

from __future__ import annotations

import base64
import binascii
import errno
import posixpath
import re
import secrets
import select
import shlex
import socket
import stat
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Mapping, Sequence, TypeVar

from cloud_adapters.base import ConnectionCheck, CredentialsError, InvalidSpec, MissingDependency, ProviderError
from cloud_adapters.slurm.transport import MAX_LISTED_FILES, MAX_READ_BYTES, CommandResult, FileEntry, link_under

if TYPE_CHECKING:
    import paramiko

_T = TypeVar("_T")

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_READ_CHUNK = 32768
_RSA_ALGORITHMS = ["rsa-sha2-512", "rsa-sha2-256"]
"""Host key algorithms of an ``ssh-rsa`` key (RFC 8332); the SHA-1 ``ssh-rsa`` signature is off in
OpenSSH since 8.8 and not among paramiko 5's host key algorithms (``Transport._preferred_keys``)."""


class HostKeyMismatch(CredentialsError):
    """The server presented another host key than the one configured (a CredentialsError: not retried)."""


def _paramiko():
    try:
        import paramiko
    except ImportError as exc:  # pragma: no cover - paramiko is pinned in requirements.txt
        raise MissingDependency(
            "the Slurm backend's SSH transport needs paramiko; install it with `pip install -r requirements.txt`."
        ) from exc
    return paramiko


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


def parse_host_key(line: str) -> "paramiko.PKey":
    """The public key of one known_hosts-style line: ``"<type> <base64> [comment]"`` or
    ``"<hosts> <type> <base64> [comment]"`` (the form ``ssh-keyscan`` prints, OpenSSH sshd(8)
    "SSH_KNOWN_HOSTS FILE FORMAT"). Markers (``@cert-authority``, ``@revoked``) and hashed host
    fields are not accepted: the line is the one key of one server.

    Raises :class:`InvalidSpec` saying what a line should look like."""
    paramiko = _paramiko()
    hint = ("expected one line as `ssh-keyscan -t ed25519 <login host>` prints it, "
            "e.g. 'login1 ssh-ed25519 AAAAC3Nza…'")
    if not isinstance(line, str) or not line.strip():
        raise InvalidSpec(f"ssh_host_key: {hint}.")
    if "\n" in line.strip() or "\r" in line:
        raise InvalidSpec(f"ssh_host_key: one line only; {hint}.")
    fields = line.split()
    if fields[0].startswith("@"):
        raise InvalidSpec(f"ssh_host_key: markers such as {fields[0]} are not supported; {hint}.")
    known = {name for cls in paramiko.key_classes for name in cls.identifiers()}
    for i, field in enumerate(fields[:2]):
        if field in known:
            break
    else:
        names = ", ".join(sorted(n for n in known if "cert" not in n))
        raise InvalidSpec(f"ssh_host_key: no key type found (one of {names}); {hint}.")
    if i + 1 >= len(fields):
        raise InvalidSpec(f"ssh_host_key: the base64 key after {field} is missing; {hint}.")
    try:
        blob = base64.b64decode(fields[i + 1], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSpec(f"ssh_host_key: the {field} key is not valid base64 key data; {hint}.") from None
    # The key data starts with its own type name (RFC 4253 §6.6: string "ssh-ed25519", ...).
    size = int.from_bytes(blob[:4], "big") if len(blob) >= 4 else -1
    inner = blob[4:4 + size].decode("ascii", "replace") if 0 < size <= 64 else ""
    if inner and inner != field and inner in known:
        raise InvalidSpec(f"ssh_host_key: the line says {field} but its key data is {inner}; {hint}.")
    try:
        return paramiko.PKey.from_type_string(field, blob)
    except (ValueError, paramiko.SSHException, TypeError, IndexError, AssertionError):
        raise InvalidSpec(f"ssh_host_key: the {field} key is not valid base64 key data; {hint}.") from None


def parse_private_key(text: str) -> "paramiko.PKey":
    """The client key from the text of a private key file: OpenSSH (``BEGIN OPENSSH PRIVATE KEY``) or
    PEM (PKCS#1 RSA, SEC1 EC, PKCS#8); Ed25519, ECDSA (NIST P-256/384/521) or RSA. Read in memory.

    Raises :class:`CredentialsError` for an encrypted key (Trainboard holds no passphrase: store a
    key without one, encrypted at rest by the dashboard) or text that is no such key. The message
    never quotes the key."""
    paramiko = _paramiko()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    data = (text or "").strip().replace("\r\n", "\n").encode("utf-8", "replace") + b"\n"
    loaded = None
    for load in (serialization.load_ssh_private_key, serialization.load_pem_private_key):
        try:
            loaded = load(data, password=None)
            break
        except TypeError:  # cryptography: "Password was not given but private key is encrypted"
            raise CredentialsError("SSH private key is encrypted with a passphrase; store a key without one "
                                   "(ssh-keygen -p -N '' -f <key file> removes it; Trainboard encrypts stored "
                                   "keys at rest).") from None
        except (ValueError, paramiko.SSHException):
            continue
        except Exception:  # cryptography's UnsupportedAlgorithm and kin: not a key we can use
            continue
    classes = ((ed25519.Ed25519PrivateKey, paramiko.Ed25519Key), (ec.EllipticCurvePrivateKey, paramiko.ECDSAKey),
               (rsa.RSAPrivateKey, paramiko.RSAKey))
    key_class = next((cls for base, cls in classes if isinstance(loaded, base)), None)
    if key_class is None:
        raise CredentialsError("SSH private key: not an Ed25519, ECDSA or RSA private key; paste the whole key file, "
                               "from its -----BEGIN … PRIVATE KEY----- line to its -----END … line.")
    # paramiko reads the OpenSSH form of every key type; normalise PEM/PKCS#8 to it, in memory.
    import io

    openssh = loaded.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()).decode("ascii")
    return key_class.from_private_key(io.StringIO(openssh))


def remote_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The command line :meth:`SshTransport.run` sends: ``shlex.join(argv)``, after
    ``env K=V …`` when ``env`` is given, so that a POSIX shell hands the program exactly ``argv``.

    Raises :class:`InvalidSpec` for an empty ``argv``, a NUL in any argument or variable, an env key
    that is not an identifier, or (with ``env``) an ``argv[0]`` that ``env`` would read as an option
    or an assignment."""
    args = [str(a) for a in argv]
    if not args or not args[0]:
        raise InvalidSpec("no command to run over SSH (empty argument list).")
    if any("\0" in a for a in args):
        raise InvalidSpec("an argument of the command contains a NUL character, which no command line can carry.")
    prefix: list[str] = []
    if env:
        bad = sorted(k for k in env if not _ENV_KEY.match(str(k)))
        if bad:
            raise InvalidSpec(f"environment variable names must be identifiers (letters, digits, _): "
                              f"{', '.join(repr(k) for k in bad)}.")
        if any("\0" in str(v) for v in env.values()):
            raise InvalidSpec("an environment variable's value contains a NUL character.")
        if args[0].startswith("-") or "=" in args[0]:
            raise InvalidSpec(f"command {args[0]!r} would be read by env(1) as an option or a variable.")
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())]
    return shlex.join(prefix + args)


# ---------------------------------------------------------------------------------------------
# The transport
# ---------------------------------------------------------------------------------------------


class SshTransport:
    """Slurm commands and files on a login node over SSH, as ``user`` with ``private_key``.

    ``host``: the login node's name or address; ``port``: its SSH port; ``user``: the account that
    submits the jobs; ``private_key``: the key file's text (:func:`parse_private_key`);
    ``host_key``: the server's key as one known_hosts line (:func:`parse_host_key`);
    ``connect_timeout``: seconds for the TCP connect, the banner, the key exchange and authentication
    each; ``env``: variables every command gets (e.g. ``SLURM_CONF``), as with
    :class:`~cloud_adapters.slurm.transport.LocalTransport` (a call's own ``env`` wins). The keys are
    parsed here (errors as those functions raise); the connection is opened on first use, reused by
    every later call and reopened once when it was dropped. Thread-safe: calls from several threads
    share the connection (one SSH channel each)."""

    def __init__(self, host: str, *, port: int = 22, user: str, private_key: str, host_key: str,
                 connect_timeout: float = 10.0, env: Mapping[str, str] | None = None) -> None:
        host = (host or "").strip() if isinstance(host, str) else ""
        if not host or any(c.isspace() for c in host):
            raise InvalidSpec(f"login_host: expected a host name or address, got {host!r:.100}.")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidSpec(f"ssh_port: expected a port from 1 to 65535, got {port!r:.100}.")
        if not isinstance(user, str) or not user.strip() or any(c.isspace() for c in user):
            raise InvalidSpec(f"ssh_user: expected a user name, got {user!r:.100}.")
        self.host = host
        self.port = port
        self.user = user.strip()
        self.connect_timeout = float(connect_timeout)
        self.env = dict(env or {})
        remote_command(["true"], self.env)  # a bad variable name is refused here, not at the first call
        self.host_key = parse_host_key(host_key)
        self._pkey = parse_private_key(private_key)
        self._lock = threading.RLock()
        self._transport: Any = None  # paramiko.Transport, open
        self._sftp: Any = None  # paramiko.SFTPClient on it, opened on first file call
        self._finalizer: weakref.finalize | None = None  # closes _transport when this object is collected

    def __repr__(self) -> str:
        return f"SshTransport({self.user}@{self.where})"

    @property
    def where(self) -> str:
        """``host`` or ``host:port``, as messages name the login node."""
        return self.host if self.port == 22 else f"{self.host}:{self.port}"

    def __enter__(self) -> "SshTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- connection -----------------------------------------------------------------------

    def _connect(self) -> Any:
        """Open, verify and authenticate a new connection (errors as the module says)."""
        paramiko = _paramiko()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except socket.gaierror as exc:
            raise ProviderError(f"cannot resolve the Slurm login host {self.host} ({exc.strerror}); "
                                f"check the login host setting and the worker's DNS; will retry.", transient=True) from None
        except (socket.timeout, TimeoutError):
            raise ProviderError(f"SSH connection to {self.where} timed out after {self.connect_timeout:g} s; "
                                f"will retry.", transient=True) from None
        except OSError as exc:
            raise ProviderError(f"cannot connect to SSH on {self.where}: {exc.strerror or exc}; is sshd running "
                                f"and the port open to the worker? Will retry.", transient=True) from None
        transport = paramiko.Transport(sock)
        try:
            transport.banner_timeout = transport.handshake_timeout = self.connect_timeout
            transport.auth_timeout = self.connect_timeout
            # Ask for the configured key's algorithm first, so a server that has it presents it.
            wanted = _RSA_ALGORITHMS if self.host_key.get_name() == "ssh-rsa" else [self.host_key.get_name()]
            options = transport.get_security_options()
            options.key_types = wanted + [k for k in options.key_types if k not in wanted]
            try:
                # start_client returns at its timeout even when the key exchange has not finished; the
                # server's key is then not there yet and get_remote_server_key raises "No existing session".
                transport.start_client(timeout=self.connect_timeout)
                presented = transport.get_remote_server_key()
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ProviderError(f"SSH handshake with {self.where} failed ({exc or type(exc).__name__}); "
                                    f"will retry.", transient=True) from None
            self._check_host_key(presented)
            try:
                transport.auth_publickey(self.user, self._pkey)
            except paramiko.AuthenticationException:
                raise CredentialsError(
                    f"SSH authentication refused: {self.where} did not accept the stored private key "
                    f"({self._pkey.get_name()} {self._pkey.fingerprint}) for user {self.user}; add its public key "
                    f"to ~{self.user}/.ssh/authorized_keys on the login node.") from None
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ProviderError(f"SSH authentication with {self.where} did not complete "
                                    f"({exc or type(exc).__name__}); will retry.", transient=True) from None
            transport.set_keepalive(30)  # notice a connection dropped by a NAT or firewall between calls
            return transport
        except BaseException:
            transport.close()
            raise

    def _check_host_key(self, presented: "paramiko.PKey") -> None:
        expected = self.host_key
        if presented.get_name() == expected.get_name() and presented.asbytes() == expected.asbytes():
            return
        raise HostKeyMismatch(
            f"host key of {self.where} does not match the one configured (server presented "
            f"{presented.get_name()} {presented.fingerprint}, configured {expected.get_name()} "
            f"{expected.fingerprint}); if the login node's key really changed, set the SSH host key to the line "
            f"`ssh-keyscan -t {expected.get_name().replace('ssh-', '')} {self.host}` prints, checked with its admin.")

    def _connection(self) -> Any:
        with self._lock:
            if self._transport is None or not self._transport.is_active():
                self._drop()
                self._transport = self._connect()
                # A backend (and its transport) lives for one task and nobody calls close(); paramiko's
                # connection thread would outlive it, so the connection closes when this object goes.
                self._finalizer = weakref.finalize(self, self._transport.close)
            return self._transport

    def _drop(self) -> None:
        with self._lock:
            sftp, transport, self._sftp, self._transport = self._sftp, self._transport, None, None
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        for thing in (sftp, transport):
            if thing is not None:
                try:
                    thing.close()
                except Exception:  # closing a dead connection: nothing left to release
                    pass

    def _retry_dropped(self, what: str, call: Callable[[Any], _T]) -> _T:
        """``call(transport)`` on the connection; when a cached connection turns out to be dropped
        (an SSH error before the operation took effect), reconnect once and call again. Errors of the
        server's own (an SFTP status such as ENOENT or EACCES, an OSError) pass through."""
        paramiko = _paramiko()
        with self._lock:
            cached = self._transport is not None and self._transport.is_active()
        for attempt in (1, 2):
            transport = self._connection()
            try:
                return call(transport)
            except (paramiko.SSHException, EOFError, ConnectionError) as exc:
                self._drop()
                if not cached or attempt == 2:
                    raise ProviderError(f"SSH connection to {self.where} dropped during {what} "
                                        f"({exc or type(exc).__name__}); will retry.", transient=True) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def check_connection(self) -> list[ConnectionCheck]:
        """Connect (or reuse the connection) and report, for a backend's Test connection, the checks
        ``"SSH connection"`` (the host answers SSH), ``"SSH host key"`` (it matches the configured one)
        and ``"SSH login"`` (the key is accepted for the user), stopping at the first that fails. Never
        raises for a failed check."""
        reach = f"{self.user}@{self.where}"
        try:
            self._connection()
        except HostKeyMismatch as exc:
            return [ConnectionCheck("SSH connection", True, f"{self.where} answers SSH"),
                    ConnectionCheck("SSH host key", False, str(exc))]
        except CredentialsError as exc:
            return [ConnectionCheck("SSH connection", True, f"{self.where} answers SSH"),
                    ConnectionCheck("SSH host key", True, f"matches {self.host_key.get_name()} {self.host_key.fingerprint}"),
                    ConnectionCheck("SSH login", False, str(exc))]
        except ProviderError as exc:
            return [ConnectionCheck("SSH connection", False, str(exc))]
        return [ConnectionCheck("SSH connection", True, f"{self.where} answers SSH"),
                ConnectionCheck("SSH host key", True, f"matches {self.host_key.get_name()} {self.host_key.fingerprint}"),
                ConnectionCheck("SSH login", True, f"logged in as {reach} with {self._pkey.get_name()} "
                                                   f"{self._pkey.fingerprint}")]

    def close(self) -> None:
        """Close the SSH connection (and its SFTP session), if open. Idempotent; a later call reconnects."""
        self._drop()

    # --- commands ---------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, input: bytes | None = None, timeout: float = 60.0,
            env: Mapping[str, str] | None = None) -> CommandResult:
        """Run ``argv`` on the login node (:func:`remote_command`) with ``input`` on its stdin (then
        end of file; no input = an empty stdin) and wait at most ``timeout`` seconds for it to exit.

        Returns its exit status and output (UTF-8, undecodable bytes replaced); -1 as the status of a
        command the server reports no exit status for (killed by a signal: sshd sends exit-signal,
        which paramiko does not read).
        Raises ProviderError(transient=True) on a timeout (the channel is closed; a command that keeps
        running after its output is gone is the remote shell's), on a connection that cannot be made
        or dropped; CredentialsError as :meth:`_connect`."""
        command = remote_command(argv, {**self.env, **(env or {})})
        deadline = time.monotonic() + timeout
        paramiko = _paramiko()

        def open_channel(transport: Any) -> Any:
            channel = transport.open_session(timeout=max(0.1, min(self.connect_timeout, deadline - time.monotonic())))
            channel.exec_command(command)
            return channel

        # Reconnecting is safe until the exec request went out: before it the command never started.
        channel = self._retry_dropped(f"starting {argv[0]}", open_channel)
        try:
            return self._collect(channel, argv[0], input or b"", deadline, timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop()
            raise ProviderError(f"SSH connection to {self.where} dropped while {argv[0]} ran "
                                f"({exc or type(exc).__name__}); will retry.", transient=True) from None
        finally:
            channel.close()

    def _collect(self, channel: Any, name: str, data: bytes, deadline: float, timeout: float) -> CommandResult:
        out: list[bytes] = []
        err: list[bytes] = []
        sent = 0
        if not data:
            channel.shutdown_write()

        def drain() -> None:
            while channel.recv_ready():
                out.append(channel.recv(_READ_CHUNK))
            while channel.recv_stderr_ready():
                err.append(channel.recv_stderr(_READ_CHUNK))

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProviderError(f"{name} did not finish within {timeout:g} s on {self.where}; will retry.",
                                    transient=True)
            return remaining

        while not (channel.eof_received or channel.closed):
            drain()
            if sent < len(data) and channel.send_ready():
                sent += channel.send(data[sent:sent + _READ_CHUNK])
                if sent >= len(data):
                    channel.shutdown_write()
            # The channel's descriptor turns readable when data or end of file arrives; while input
            # is pending, poll briefly, since room to send is not signalled through it.
            select.select([channel], [], [], min(left(), 0.05 if sent < len(data) else 1.0))
        drain()
        # The exit status follows the end of output (sshd sends exit-status, then close).
        while not channel.exit_status_ready():
            channel.status_event.wait(min(left(), 1.0))
        drain()
        if channel.exit_status == -1 and not (self._transport and self._transport.is_active()):
            raise EOFError("the connection closed before the command's exit status came")
        return CommandResult(channel.exit_status, b"".join(out).decode("utf-8", "replace"),
                             b"".join(err).decode("utf-8", "replace"))

    # --- files ------------------------------------------------------------------------------

    def _sftp_client(self, transport: Any) -> Any:
        with self._lock:
            if self._sftp is None or self._sftp.get_channel().get_transport() is not transport:
                self._sftp = _paramiko().SFTPClient.from_transport(transport)
                self._sftp.get_channel().settimeout(max(self.connect_timeout, 30.0))
            return self._sftp

    def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Write ``data`` to the absolute ``path`` on the login node atomically: a temporary file
        beside it (``.tmp-<random>``, given ``mode`` before any byte is written), then
        ``posix-rename@openssh.com`` over ``path``. Missing parent directories are made (mode 0o700).

        Raises InvalidSpec for a relative path, PermissionError / OSError as the server reports them,
        ProviderError(transient=True) when the connection drops."""
        _absolute(path)
        parent = posixpath.dirname(path)

        def write(transport: Any) -> None:
            sftp = self._sftp_client(transport)
            _makedirs(sftp, parent)
            tmp = posixpath.join(parent, f".tmp-{secrets.token_hex(8)}")
            try:
                with sftp.open(tmp, "wb") as fh:
                    fh.chmod(mode)
                    fh.set_pipelined(True)
                    fh.write(data)
                sftp.posix_rename(tmp, path)
            except BaseException:
                try:
                    sftp.remove(tmp)
                except Exception:  # it may never have been created, or the connection is gone
                    pass
                raise

        self._retry_dropped(f"writing {path}", write)

    def read_file(self, path: str, *, offset: int = 0, limit: int = MAX_READ_BYTES) -> bytes:
        """Up to ``limit`` bytes (at most :data:`MAX_READ_BYTES`) of ``path`` from byte ``offset``;
        b"" at or past its end. Raises FileNotFoundError when the file does not exist (yet),
        ProviderError(transient=True) when the connection drops."""
        _absolute(path)
        count = max(0, min(int(limit), MAX_READ_BYTES))

        def read(transport: Any) -> bytes:
            sftp = self._sftp_client(transport)
            try:
                with sftp.open(path, "rb") as fh:
                    fh.seek(max(0, int(offset)))
                    chunks, left = [], count
                    while left > 0:
                        chunk = fh.read(min(left, _READ_CHUNK * 8))
                        if not chunk:
                            break
                        chunks.append(chunk)
                        left -= len(chunk)
                    return b"".join(chunks)
            except OSError as exc:
                if exc.errno == errno.ENOENT or isinstance(exc, FileNotFoundError):
                    raise FileNotFoundError(errno.ENOENT, f"no such file on {self.where}", path) from None
                raise

        return self._retry_dropped(f"reading {path}", read)


    def list_files(self, root: str, *, recursive: bool = True) -> list[FileEntry]:
        """Every regular file under ``root`` on the login node, by SFTP READDIR (whose attributes are
        the entries' own: a link is seen as a link, never followed), at most
        :data:`~cloud_adapters.slurm.transport.MAX_LISTED_FILES`; [] when ``root`` is missing or a link."""
        _absolute(root)

        def walk(transport: Any) -> list[FileEntry]:
            sftp = self._sftp_client(transport)
            try:
                if not stat.S_ISDIR(sftp.lstat(root).st_mode):
                    return []
            except FileNotFoundError:
                return []
            found: list[FileEntry] = []
            pending = [""]
            while pending and len(found) < MAX_LISTED_FILES:
                rel = pending.pop()
                try:
                    entries = sftp.listdir_attr(posixpath.join(root, rel) if rel else root)
                except FileNotFoundError:
                    continue
                for entry in sorted(entries, key=lambda e: e.filename):
                    child = posixpath.join(rel, entry.filename) if rel else entry.filename
                    if stat.S_ISDIR(entry.st_mode):
                        if recursive:
                            pending.append(child)
                    elif stat.S_ISREG(entry.st_mode):
                        found.append(FileEntry(child, int(entry.st_size or 0), float(entry.st_mtime or 0)))
            return sorted(found[:MAX_LISTED_FILES], key=lambda f: f.path)

        return self._retry_dropped(f"listing {root}", walk)

    def open_file(self, path: str, *, root: str) -> BinaryIO:
        """``path`` opened over SFTP after an LSTAT of ``root`` and of each part below it: a link on
        the way is refused (PermissionError), since SFTP's OPEN would follow it."""
        _absolute(path)

        def open_(transport: Any) -> BinaryIO:
            sftp = self._sftp_client(transport)
            if link_under(root, path, sftp.lstat):
                raise PermissionError(f"{path}: a symbolic link on the way; not opened")
            return sftp.open(path, "rb", bufsize=_READ_CHUNK * 8)

        return self._retry_dropped(f"opening {path}", open_)


def _absolute(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidSpec(f"expected an absolute path on the cluster, got {path!r:.200}.")


def _makedirs(sftp: Any, directory: str) -> None:
    """Make ``directory`` and its missing parents on the server (mode 0o700)."""
    missing: list[str] = []
    current = directory
    while current not in ("", "/"):
        try:
            sftp.stat(current)
            break
        except FileNotFoundError:
            missing.append(current)
            current = posixpath.dirname(current)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
            missing.append(current)
            current = posixpath.dirname(current)
    for path in reversed(missing):
        try:
            sftp.mkdir(path, 0o700)
        except OSError:
            sftp.stat(path)  # made meanwhile by another writer: fine; else the stat raises the reason
