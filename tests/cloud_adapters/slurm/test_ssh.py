"""SshTransport against a real OpenSSH server (Debian's sshd on 127.0.0.1, tests/sshkit.py).

What crosses the wire is checked on the far side: a Python one-liner prints the argv it received as
JSON, so a hostile argument that a shell would have interpreted shows up as the literal string.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import stat
import subprocess
import time

import pytest

from cloud_adapters.base import CredentialsError, InvalidSpec, ProviderError
from cloud_adapters.slurm.ssh import SshTransport, parse_host_key, parse_private_key, remote_command
from cloud_adapters.slurm.transport import MAX_READ_BYTES
from polling import wait_for
from sshkit import free_port, keygen, sshd_server

PRINT_ARGV = ["python3", "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with sshd_server(tmp_path_factory.mktemp("sshd")) as running:
        yield running


@pytest.fixture
def transport(server):
    t = SshTransport("127.0.0.1", port=server.port, user=server.user, private_key=server.client_key,
                     host_key=server.host_key_line, connect_timeout=10)
    yield t
    t.close()


def _transport(server, **overrides) -> SshTransport:
    kwargs = dict(port=server.port, user=server.user, private_key=server.client_key,
                  host_key=server.host_key_line, connect_timeout=10)
    kwargs.update(overrides)
    return SshTransport("127.0.0.1", **kwargs)


# --- commands -----------------------------------------------------------------------------


HOSTILE = ["; rm -rf /", "$(touch /tmp/trainboard-pwned)", "`id`", "a'b\"c", "line1\nline2", "  spaced  ",
           "", "*", "$HOME", "\\", "--help", "ünïcödé", "x > /tmp/out", "&& echo no"]


def test_hostile_arguments_reach_the_command_as_literal_argv(transport, tmp_path):
    result = transport.run([*PRINT_ARGV, *HOSTILE])

    assert result.ok, result
    assert json.loads(result.stdout) == HOSTILE
    assert result.stderr == ""
    assert not os.path.exists("/tmp/trainboard-pwned")


def test_exit_status_and_both_streams_come_back(transport):
    result = transport.run(["sh", "-c", "echo out; echo err >&2; exit 7"])

    assert (result.returncode, result.stdout, result.stderr, result.ok) == (7, "out\n", "err\n", False)
    assert transport.run(["false"]).returncode == 1
    missing = transport.run(["no-such-command-trainboard"])
    assert missing.returncode == 127 and "no-such-command-trainboard" in missing.stderr


def test_a_command_killed_by_a_signal_reports_minus_one(transport):
    assert transport.run(["sh", "-c", "kill -9 $$"]).returncode == -1


def test_stdin_input_is_delivered_then_closed(transport):
    script = b"#!/bin/bash\n#SBATCH --job-name='x; y'\nsrun echo \"$SLURM_NODEID\"\n"
    assert transport.run(["cat"], input=script).stdout == script.decode()
    # No input: stdin is closed at once, so a reader does not wait for the timeout.
    assert transport.run(["cat"], timeout=20).stdout == ""


def test_large_input_and_output_do_not_deadlock(transport):
    # 3 MiB each way: more than an SSH window (2 MiB in paramiko), written while the far side echoes.
    data = os.urandom(3 * 1024 * 1024).hex().encode()[: 3 * 1024 * 1024]
    result = transport.run(["cat"], input=data, timeout=120)

    assert result.ok
    assert result.stdout.encode() == data


def test_env_is_set_for_the_command_only(transport):
    env = {"SLURM_CONF": "/etc/slurm/slurm x.conf", "TB_ODD": "$(id); 'q' \"d\"\nnext"}
    result = transport.run([*PRINT_ARGV[:2], "import os, json; print(json.dumps([os.environ['SLURM_CONF'], "
                                             "os.environ['TB_ODD']]))"], env=env)

    assert json.loads(result.stdout) == [env["SLURM_CONF"], env["TB_ODD"]]
    assert transport.run(["sh", "-c", 'echo "[$TB_ODD]"']).stdout == "[]\n"


def test_the_transports_own_env_reaches_every_command_and_a_calls_env_wins(server):
    with _transport(server, env={"SLURM_CONF": "/shared/slurm.conf", "TB_A": "transport"}) as t:
        both = t.run(["sh", "-c", 'echo "$SLURM_CONF|$TB_A"'], env={"TB_A": "call"})
        plain = t.run(["sh", "-c", 'echo "$SLURM_CONF|$TB_A"'])
    assert (both.stdout, plain.stdout) == ("/shared/slurm.conf|call\n", "/shared/slurm.conf|transport\n")
    with pytest.raises(InvalidSpec, match="identifiers"):
        _transport(server, env={"BAD-NAME": "1"})


def test_bad_env_keys_and_arguments_are_refused_before_any_connection(server):
    t = _transport(server)
    with pytest.raises(InvalidSpec, match="identifiers.*'A B'.*'X;Y'"):
        t.run(["true"], env={"X;Y": "1", "A B": "2", "OK": "3"})
    with pytest.raises(InvalidSpec, match="option or a variable"):
        t.run(["-i", "sh"], env={"A": "1"})
    with pytest.raises(InvalidSpec, match="NUL"):
        t.run(["echo", "a\0b"])
    with pytest.raises(InvalidSpec, match="empty"):
        t.run([])
    assert t._transport is None  # nothing was sent


def test_remote_command_quotes_for_a_posix_shell():
    assert remote_command(["squeue", "-h", "-o", "%i|%j"]) == "squeue -h -o '%i|%j'"
    assert remote_command(["sbatch", "--parsable"], {"SLURM_CONF": "/a b"}) == "env 'SLURM_CONF=/a b' sbatch --parsable"


def test_a_command_past_its_timeout_is_a_transient_error_and_the_connection_stays_usable(transport):
    started = time.monotonic()
    with pytest.raises(ProviderError, match=r"did not finish within 0.5 s") as caught:
        transport.run(["sleep", "3"], timeout=0.5)
    assert caught.value.transient
    assert time.monotonic() - started < 3

    assert transport.run(["echo", "still here"]).stdout == "still here\n"


def test_one_connection_serves_every_call(server, transport):
    for i in range(3):
        assert transport.run(["echo", str(i)]).stdout == f"{i}\n"
    transport.write_file(str(server.directory / "files" / "one.txt"), b"1")
    assert transport.read_file(str(server.directory / "files" / "one.txt")) == b"1"

    assert len(server.connection_pids()) == 1


def test_a_dropped_connection_is_reopened_once(server, transport):
    assert transport.run(["echo", "before"]).ok
    server.drop_connections()

    assert transport.run(["echo", "after"]).stdout == "after\n"
    server.drop_connections()
    path = str(server.directory / "files" / "after-drop.txt")
    transport.write_file(path, b"written after a drop")
    server.drop_connections()
    assert transport.read_file(path) == b"written after a drop"


def test_a_transport_nobody_closes_closes_its_connection_when_it_goes(server):
    # A backend lives for one Celery task and nobody closes it: its connection must not outlive it.
    before = set(server.connection_pids())
    t = _transport(server)
    assert t.run(["true"]).ok
    (mine,) = set(server.connection_pids()) - before
    del t
    gc.collect()

    wait_for(lambda: mine not in server.connection_pids(), timeout=10, what="the connection to close")


def test_close_is_idempotent_and_a_later_call_reconnects(server, transport):
    transport.run(["true"])
    transport.close()
    transport.close()
    assert transport.run(["echo", "again"]).stdout == "again\n"


# --- files --------------------------------------------------------------------------------


def test_write_file_makes_parents_sets_the_mode_and_replaces_atomically(server, transport):
    target = server.directory / "jobs" / "tb-job-7" / "deep" / "job.sbatch"
    transport.write_file(str(target), b"#!/bin/bash\necho one\n", mode=0o640)
    transport.write_file(str(target), b"#!/bin/bash\necho two\n", mode=0o750)

    assert target.read_bytes() == b"#!/bin/bash\necho two\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert stat.S_IMODE((server.directory / "jobs" / "tb-job-7").stat().st_mode) == 0o700
    assert sorted(p.name for p in target.parent.iterdir()) == ["job.sbatch"]  # no temporary file left


def test_read_file_by_offset_and_limit(server, transport):
    path = server.directory / "logs" / "slurm-42.out"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"".join(f"line {i}\n".encode() for i in range(1000)))
    whole = path.read_bytes()

    assert transport.read_file(str(path)) == whole
    assert transport.read_file(str(path), offset=7, limit=14) == whole[7:21]
    assert transport.read_file(str(path), offset=len(whole) - 3) == whole[-3:]
    assert transport.read_file(str(path), offset=len(whole) + 10) == b""
    assert transport.read_file(str(path), limit=0) == b""


def test_read_file_returns_at_most_max_read_bytes(server, transport):
    path = server.directory / "big.out"
    path.write_bytes(b"x" * (MAX_READ_BYTES + 1000))

    assert len(transport.read_file(str(path), limit=MAX_READ_BYTES * 2)) == MAX_READ_BYTES


def test_read_of_a_missing_file_is_file_not_found(server, transport):
    with pytest.raises(FileNotFoundError):
        transport.read_file(str(server.directory / "not-there.out"))
    assert transport.run(["true"]).ok  # the connection is fine afterwards


def test_relative_paths_are_refused(transport):
    with pytest.raises(InvalidSpec, match="absolute path"):
        transport.write_file("relative/job.sbatch", b"")
    with pytest.raises(InvalidSpec, match="absolute path"):
        transport.read_file("../etc/passwd")


# --- trust and credentials ----------------------------------------------------------------


def test_a_different_host_key_is_refused_naming_both_fingerprints(server, tmp_path):
    _, other = keygen(tmp_path / "impostor", "ed25519")
    t = _transport(server, host_key=other)

    with pytest.raises(CredentialsError, match="host key of 127.0.0.1:.* does not match the one configured") as caught:
        t.run(["true"])
    expected = parse_host_key(other).fingerprint
    presented = parse_host_key(server.host_keys["ed25519"]).fingerprint
    assert expected in str(caught.value) and presented in str(caught.value)
    assert not caught.value.transient


def test_the_servers_rsa_key_is_accepted_when_that_is_the_one_configured(server):
    with _transport(server, host_key=server.host_keys["rsa"]) as t:
        assert t.run(["echo", "rsa"]).stdout == "rsa\n"


def test_another_rsa_key_is_refused(server, tmp_path):
    _, other = keygen(tmp_path / "impostor_rsa", "rsa")
    with pytest.raises(CredentialsError, match="does not match"):
        _transport(server, host_key=other).run(["true"])


def test_a_key_the_server_does_not_accept_is_refused(server, tmp_path):
    stranger, _ = keygen(tmp_path / "stranger", "ed25519")
    t = _transport(server, private_key=stranger)

    with pytest.raises(CredentialsError, match=r"SSH authentication refused: .* for user " + server.user) as caught:
        t.run(["true"])
    assert "authorized_keys" in str(caught.value)
    assert "PRIVATE KEY" not in str(caught.value)


def test_a_wrong_user_is_refused(server):
    with pytest.raises(CredentialsError, match="authentication refused.*trainboard-nobody"):
        _transport(server, user="trainboard-nobody").run(["true"])


@pytest.mark.parametrize("key_type,fmt", [("rsa", "PEM"), ("ecdsa", "PEM"), ("ecdsa", "PKCS8"), ("rsa", None)])
def test_rsa_and_ecdsa_keys_in_pem_and_openssh_form_log_in(server, tmp_path, key_type, fmt):
    private, public = keygen(tmp_path / f"client_{key_type}", key_type, fmt=fmt)
    server.authorize(public)
    with _transport(server, private_key=private) as t:
        assert t.run(["echo", key_type]).stdout == f"{key_type}\n"


def test_nothing_listening_is_a_transient_error(tmp_path, server):
    t = _transport(server, port=free_port(), connect_timeout=2)
    with pytest.raises(ProviderError, match="cannot connect to SSH on 127.0.0.1:") as caught:
        t.run(["true"])
    assert caught.value.transient


def test_a_port_that_never_speaks_ssh_is_a_transient_error(server):
    # A listening socket nobody accepts on: the kernel completes the TCP handshake, no banner ever comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        t = _transport(server, port=silent.getsockname()[1], connect_timeout=1)
        started = time.monotonic()
        with pytest.raises(ProviderError, match="SSH handshake with 127.0.0.1:.* failed") as caught:
            t.run(["true"])
    assert caught.value.transient
    assert time.monotonic() - started < 30  # bounded by connect_timeout, not paramiko's defaults


def test_a_server_stopped_after_the_first_call_gives_a_transient_error(tmp_path):
    with sshd_server(tmp_path / "first") as first:
        t = _transport(first)
        assert t.run(["true"]).ok
    with pytest.raises(ProviderError) as caught:
        t.run(["true"])
    assert caught.value.transient
    t.close()


def test_check_connection_names_the_step_that_fails(server, tmp_path):
    with _transport(server) as good:
        checks = good.check_connection()
    assert [(c.name, c.ok) for c in checks] == [("SSH connection", True), ("SSH host key", True), ("SSH login", True)]
    assert checks[2].message.startswith(f"logged in as {server.user}@127.0.0.1:{server.port} with ssh-ed25519 SHA256:")

    _, impostor = keygen(tmp_path / "impostor_host", "ed25519")
    checks = _transport(server, host_key=impostor).check_connection()
    assert [(c.name, c.ok) for c in checks] == [("SSH connection", True), ("SSH host key", False)]
    assert "does not match the one configured" in checks[1].message

    stranger, _ = keygen(tmp_path / "stranger_key", "ed25519")
    checks = _transport(server, private_key=stranger).check_connection()
    assert [(c.name, c.ok) for c in checks] == [("SSH connection", True), ("SSH host key", True), ("SSH login", False)]
    assert "SSH authentication refused" in checks[2].message

    checks = _transport(server, port=free_port(), connect_timeout=2).check_connection()
    assert [(c.name, c.ok) for c in checks] == [("SSH connection", False)]
    assert "cannot connect to SSH on 127.0.0.1:" in checks[0].message and "Connection refused" in checks[0].message


# --- parsing --------------------------------------------------------------------------------


def test_host_key_lines_in_the_forms_ssh_keyscan_and_known_hosts_use(server):
    bare = server.host_keys["ed25519"]
    key = parse_host_key(bare)
    for line in (bare, f"login1 {bare}", f"[login1]:2222,10.0.0.5 {bare} comment words", f"  {bare}  "):
        assert parse_host_key(line).asbytes() == key.asbytes()
    assert key.get_name() == "ssh-ed25519"


@pytest.mark.parametrize("line,message", [
    ("", "expected one line"),
    ("login1", "no key type"),
    ("ssh-ed25519", "base64 key after ssh-ed25519 is missing"),
    ("ssh-ed25519 not-base64!!", "not valid base64"),
    ("@cert-authority *.example ssh-ed25519 AAAA", "markers"),
    ("ssh-ed25519 AAAA\nssh-rsa BBBB", "one line only"),
])
def test_bad_host_key_lines_say_what_a_line_looks_like(line, message):
    with pytest.raises(InvalidSpec, match=message) as caught:
        parse_host_key(line)
    assert "ssh-keyscan -t ed25519" in str(caught.value)


def test_a_host_key_whose_data_is_another_type_is_refused(server):
    rsa_blob = server.host_keys["rsa"].split()[1]
    with pytest.raises(InvalidSpec, match="says ssh-ed25519 but its key data is ssh-rsa"):
        parse_host_key(f"ssh-ed25519 {rsa_blob}")


def test_an_encrypted_private_key_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret-pass", "-f", str(path)], check=True,
                   capture_output=True, timeout=60)
    with pytest.raises(CredentialsError, match="encrypted with a passphrase.*ssh-keygen -p"):
        parse_private_key(path.read_text())


@pytest.mark.parametrize("text", ["", "not a key", "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----"])
def test_text_that_is_no_private_key_is_refused_without_quoting_it(text):
    with pytest.raises(CredentialsError, match="paste the whole key file") as caught:
        parse_private_key(text)
    assert "AAAA" not in str(caught.value)


def test_settings_that_cannot_name_a_login_are_refused(server):
    with pytest.raises(InvalidSpec, match="login_host"):
        _transport(server).__class__("", user="u", private_key=server.client_key, host_key=server.host_key_line)
    with pytest.raises(InvalidSpec, match="ssh_port"):
        _transport(server, port=70000)
    with pytest.raises(InvalidSpec, match="ssh_user"):
        _transport(server, user="a b")
