"""Parsing of the security flags and files (llmserve/security.py, security_args.py): errors name
the flag and never show a secret; secrets stay out of reprs."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.security import BearerToken, ChannelTls, SecurityConfigError, ServerTls, TokenTable, _bearer
from llmserve.security_args import (
    add_client_args,
    add_internal_channel_args,
    add_server_args,
    client_security_from_args,
    internal_security_from_args,
    server_security_from_args,
)
from tests.certs import OPENSSL, Pki, make_pki

SECRET = "s3cret-token-value-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _file(tmp_path: Path, text: str, name: str = "tokens") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


# ---- token files ---------------------------------------------------------------------------------


def test_token_file_lines_give_identities_and_roles(tmp_path) -> None:
    other = "another-token-abcdefghijklmnop"
    third = "third-token-abcdefghijklmnopq"
    table = TokenTable.from_file(_file(tmp_path, f"# comment\n\n{SECRET} alice admin\n  {other} bob \n{third}\n"),
                                 "--auth-token-file")
    alice, bob, anon = (table.lookup(t) for t in (SECRET, other, third))
    assert (alice.identity, alice.roles) == ("alice", frozenset({"admin"}))
    assert (bob.identity, bob.roles) == ("bob", frozenset())
    assert anon.identity.startswith("token-") and len(anon.identity) == 14
    assert table.lookup("wrong-token-abcdefghijklmnop") is None
    assert table.lookup(SECRET[:-1]) is None and table.lookup("") is None and table.lookup("tökén") is None
    assert BearerToken.from_file(tmp_path / "tokens").value == SECRET  # a client sends the first
    assert SECRET not in repr(table) and SECRET not in repr(BearerToken(SECRET))


@pytest.mark.parametrize("text, message", [
    ("", "holds no token"),
    ("# only a comment\n", "holds no token"),
    ("short\n", "line 1: a token must be 16-4096 characters, got 5"),
    (f"{SECRET} alice\n{SECRET} bob\n", "line 2: the same token as line 1"),
    (f"{SECRET} alice root\n", "line 1: unknown role(s) root"),
    (f"{SECRET} a b c\n", "line 1: expected `TOKEN [IDENTITY [ROLE,...]]`, got 4 fields"),
    (f"{SECRET} al!ce\n", "line 1: the identity must be"),
])
def test_bad_token_files_name_the_flag_and_line_but_not_the_token(tmp_path, text, message) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(SecurityConfigError) as info:
        TokenTable.from_file(path, "--auth-token-file")
    assert str(info.value).startswith(f"--auth-token-file: {path}")
    assert message in str(info.value)
    assert SECRET not in str(info.value)


def test_unreadable_and_non_ascii_token_files_name_the_flag(tmp_path) -> None:
    with pytest.raises(SecurityConfigError, match=r"^--internal-token-file: cannot read .*missing"):
        TokenTable.from_file(tmp_path / "missing", "--internal-token-file")
    path = tmp_path / "latin"
    path.write_bytes(b"t\xf6ken-0123456789abcdef\n")
    with pytest.raises(SecurityConfigError, match=r"^--token-file: .* is not an ASCII text file"):
        BearerToken.from_file(path, "--token-file")


def test_bearer_metadata_parsing() -> None:
    assert _bearer(()) is None
    assert _bearer((("x-request-id", "r"), ("authorization", f"Bearer {SECRET}"))) == SECRET
    assert _bearer((("authorization", f"bearer  {SECRET} "),)) == SECRET
    assert _bearer((("authorization", f"Basic {SECRET}"),)) == ""
    assert _bearer((("authorization", "Bearer"),)) == ""
    with pytest.raises(SecurityConfigError, match="16-4096"):
        BearerToken("short")
    with pytest.raises(SecurityConfigError, match="visible ASCII"):
        BearerToken("a" * 10 + "\u00e9" * 10)


# ---- certificates --------------------------------------------------------------------------------


def test_server_tls_loads_and_hides_its_key(pki) -> None:
    tls = ServerTls.from_files(pki.server_cert, pki.server_key, pki.ca)
    assert tls.mutual and b"PRIVATE KEY" in tls.private_key
    assert "PRIVATE" not in repr(tls)
    assert tls.credentials() is not None
    assert not ServerTls.from_files(pki.server_cert, pki.server_key).mutual


def test_bad_certificate_files_are_startup_errors_naming_the_flag(pki, tmp_path) -> None:
    cases = [
        (lambda: ServerTls.from_files(tmp_path / "nope.pem", pki.server_key), r"^--tls-cert: cannot read .*nope\.pem"),
        (lambda: ServerTls.from_files(pki.server_cert, tmp_path / "nope.key"), r"^--tls-key: cannot read"),
        (lambda: ServerTls.from_files(pki.server_key, pki.server_key), r"^--tls-cert: .* holds no PEM certificate"),
        (lambda: ServerTls.from_files(pki.server_cert, pki.ca), r"^--tls-key: .* holds no PEM private key"),
        (lambda: ServerTls.from_files(pki.server_cert, pki.client_key),
         r"^--tls-key: .* is not the private key of --tls-cert"),
        (lambda: ServerTls.from_files(pki.server_cert, pki.server_key, pki.server_key),
         r"^--tls-client-ca: .* holds no PEM certificate"),
        (lambda: ChannelTls.from_files(ca=tmp_path / "ca.pem"), r"^--tls-ca: cannot read"),
        (lambda: ChannelTls.from_files(ca=pki.ca, cert=pki.client_cert), r"^--tls-key: needed with --tls-cert"),
        (lambda: ChannelTls.from_files(ca=pki.ca, cert=pki.client_cert, key=pki.server_key,
                                       flags=("--internal-tls-ca", "--internal-tls-cert", "--internal-tls-key")),
         r"^--internal-tls-key: .* is not the private key of --internal-tls-cert"),
    ]
    for load, pattern in cases:
        with pytest.raises(SecurityConfigError, match=pattern):
            load()


def test_encrypted_private_keys_are_refused_without_a_prompt(pki, tmp_path) -> None:
    encrypted = tmp_path / "encrypted.key"
    subprocess.run([OPENSSL, "pkey", "-in", str(pki.server_key), "-aes256", "-passout", "pass:pw",
                    "-out", str(encrypted)], check=True, capture_output=True, timeout=30)
    with pytest.raises(SecurityConfigError, match=r"^--tls-key: .*encrypted private keys are not supported"):
        ServerTls.from_files(pki.server_cert, encrypted)


# ---- flags ---------------------------------------------------------------------------------------


def _server_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p, "--auth-token-file", "tokens")
    return p.parse_args(argv)


def test_server_flags_parse_into_one_security_config(pki, tmp_path) -> None:
    assert server_security_from_args(_server_args(), "--auth-token-file") == \
        server_security_from_args(_server_args(), "--auth-token-file")  # plaintext, no auth
    plain = server_security_from_args(_server_args(), "--auth-token-file")
    assert plain.tls is None and plain.tokens is None and plain.interceptors() == []
    tokens = _file(tmp_path, f"{SECRET} alice\n")
    full = server_security_from_args(_server_args("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                                                  "--tls-client-ca", str(pki.ca), "--auth-token-file", str(tokens)),
                                     "--auth-token-file")
    assert full.tls.mutual and full.tokens.lookup(SECRET).identity == "alice"
    assert len(full.interceptors()) == 1
    for argv, pattern in [
        (("--tls-cert", str(pki.server_cert)), r"^--tls-key: needed with --tls-cert"),
        (("--tls-key", str(pki.server_key)), r"^--tls-cert: needed with --tls-key"),
        (("--tls-client-ca", str(pki.ca)), r"^--tls-client-ca: needs --tls-cert"),
        (("--auth-token-file", str(tmp_path / "none")), r"^--auth-token-file: cannot read"),
    ]:
        with pytest.raises(SecurityConfigError, match=pattern):
            server_security_from_args(_server_args(*argv), "--auth-token-file")


def test_internal_and_client_flags(pki, tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_internal_channel_args(p)
    token = _file(tmp_path, f"{SECRET}\nnext-token-0123456789abcdef\n")
    internal = internal_security_from_args(p.parse_args(["--internal-tls-ca", str(pki.ca), "--internal-tls-cert",
                                                         str(pki.client_cert), "--internal-tls-key",
                                                         str(pki.client_key), "--internal-token-file", str(token)]))
    assert internal.tls.client_cert and internal.token.value == SECRET
    assert internal.metadata() == (("authorization", f"Bearer {SECRET}"),)
    assert internal_security_from_args(p.parse_args([])).tls is None
    with pytest.raises(SecurityConfigError, match="^--internal-tls-ca: needed"):
        internal_security_from_args(p.parse_args(["--internal-tls-cert", str(pki.client_cert),
                                                  "--internal-tls-key", str(pki.client_key)]))
    with pytest.raises(SecurityConfigError, match="^--internal-tls-server-name: needs --internal-tls-ca"):
        internal_security_from_args(p.parse_args(["--internal-tls-server-name", "x"]))

    c = argparse.ArgumentParser()
    add_client_args(c)
    assert client_security_from_args(c.parse_args(["--tls"])).tls.root_ca is None  # the system's roots
    client = client_security_from_args(c.parse_args(["--tls-ca", str(pki.ca), "--tls-server-name", "localhost",
                                                     "--token-file", str(token)]))
    assert client.tls.channel_options() == [("grpc.ssl_target_name_override", "localhost"),
                                            ("grpc.default_authority", "localhost")]
    assert client.token.value == SECRET


@pytest.mark.parametrize("command", [
    ["router", "--tokenizer", "127.0.0.1:1", "--workers", "127.0.0.1:2"],
    ["tokenizer", "--model", "MODEL"],
    ["worker", "--model", "MODEL"],
])
def test_servers_exit_2_naming_the_flag_of_a_missing_certificate(command, model_factory, tmp_path) -> None:
    model = str(model_factory("tiny"))
    argv = [model if a == "MODEL" else a for a in command]
    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", *argv, "--port", "0", "--tls-cert",
                           str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.key")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"--tls-cert: cannot read {tmp_path / 'missing.pem'}" in proc.stderr
