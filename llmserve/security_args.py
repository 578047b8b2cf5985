"""Security command-line flags (llmserve/security.py has the model), parsed once into its frozen
configs at the edge. Every flag takes a file path: secrets never appear in process arguments.

    servers:  --tls-cert F --tls-key F [--tls-client-ca F]   plus the token file they accept:
              --auth-token-file F (router: client tokens) / --internal-token-file F (worker, tokenizer)
    router -> tokenizer and workers:
              --internal-tls-ca F [--internal-tls-cert F --internal-tls-key F] [--internal-tls-server-name N]
              --internal-token-file F (sent on every internal call)
    clients (generate, chat, health):
              --tls | --tls-ca F, [--tls-cert F --tls-key F] [--tls-server-name N], --token-file F
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# llmserve/security.py (and grpc) load only when flags are parsed: registering subcommands stays light.
if TYPE_CHECKING:
    from llmserve.security import ChannelSecurity, ServerSecurity


def add_server_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, token_flag: str,
                    token_help: str) -> None:
    """--tls-cert/--tls-key/--tls-client-ca and `token_flag` (the tokens this server accepts)."""
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="serve TLS with this PEM certificate chain (default: plaintext)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None, metavar="FILE",
                        help="require client certificates signed by this PEM CA (mTLS; needs --tls-cert)")
    parser.add_argument(token_flag, default=None, metavar="FILE", help=token_help)


def server_security_from_args(args: argparse.Namespace, token_flag: str) -> ServerSecurity:
    from llmserve.security import SecurityConfigError, ServerSecurity, ServerTls, TokenTable

    cert, key, client_ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if (cert is None) != (key is None):
        missing, given = ("--tls-cert", "--tls-key") if cert is None else ("--tls-key", "--tls-cert")
        raise SecurityConfigError(f"{missing}: needed with {given} (a certificate and its private key)")
    if client_ca is not None and cert is None:
        raise SecurityConfigError("--tls-client-ca: needs --tls-cert and --tls-key (mTLS is on top of TLS)")
    tls = ServerTls.from_files(cert, key, client_ca) if cert is not None else None
    token_file = getattr(args, token_flag.lstrip("-").replace("-", "_"))
    tokens = TokenTable.from_file(token_file, token_flag) if token_file is not None else None
    return ServerSecurity(tls, tokens)


def add_internal_channel_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The router's side of its channels to the tokenizer service and the workers."""
    parser.add_argument("--internal-tls-ca", default=None, metavar="FILE",
                        help="reach the tokenizer service and workers over TLS, verifying them with this PEM CA")
    parser.add_argument("--internal-tls-cert", default=None, metavar="FILE",
                        help="client certificate presented to them (when they require mTLS)")
    parser.add_argument("--internal-tls-key", default=None, metavar="FILE", help="the key of --internal-tls-cert")
    parser.add_argument("--internal-tls-server-name", default=None, metavar="NAME",
                        help="name their certificates carry, when it differs from the host dialled")
    parser.add_argument("--internal-token-file", default=None, metavar="FILE",
                        help="send this file's first token on every call to them (they accept it "
                        "with the same --internal-token-file)")


def internal_security_from_args(args: argparse.Namespace) -> ChannelSecurity:
    from llmserve.security import BearerToken, ChannelSecurity, ChannelTls, SecurityConfigError

    tls = None
    if args.internal_tls_ca or args.internal_tls_cert or args.internal_tls_key:
        if args.internal_tls_ca is None:
            raise SecurityConfigError("--internal-tls-ca: needed with --internal-tls-cert (the CA that "
                                      "signed the tokenizer's and workers' certificates)")
        tls = ChannelTls.from_files(args.internal_tls_ca, args.internal_tls_cert, args.internal_tls_key,
                                    args.internal_tls_server_name,
                                    flags=("--internal-tls-ca", "--internal-tls-cert", "--internal-tls-key"))
    elif args.internal_tls_server_name:
        raise SecurityConfigError("--internal-tls-server-name: needs --internal-tls-ca")
    token = (BearerToken.from_file(args.internal_token_file, "--internal-token-file")
             if args.internal_token_file else None)
    return ChannelSecurity(tls, token)


def add_client_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, token: bool = True) -> None:
    parser.add_argument("--tls", action="store_true",
                        help="connect over TLS, verifying the server with the system's CA roots")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="connect over TLS, verifying the server with this PEM CA")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="client certificate to present (servers that require mTLS)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="name the server's certificate carries, when it differs from the host dialled")
    if token:
        parser.add_argument("--token-file", default=None, metavar="FILE",
                            help="send this file's first token (`authorization: Bearer`)")


def client_security_from_args(args: argparse.Namespace) -> ChannelSecurity:
    from llmserve.security import BearerToken, ChannelSecurity, ChannelTls, SecurityConfigError

    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        tls = ChannelTls.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    elif args.tls_server_name:
        raise SecurityConfigError("--tls-server-name: needs --tls or --tls-ca")
    token_file = getattr(args, "token_file", None)
    token = BearerToken.from_file(token_file, "--token-file") if token_file else None
    return ChannelSecurity(tls, token)


# ---- `llmserve serve`: one certificate and one client-token file for the whole local cluster ------


def add_serve_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="every service serves TLS with this PEM certificate (default: plaintext); it must "
                        "name the host the services are reached at (see --tls-server-name)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="the CA that signed --tls-cert, which the router and serve verify the services "
                        "with (default: --tls-cert itself, for a self-signed certificate)")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="name --tls-cert carries, when it differs from the host dialled")
    parser.add_argument("--auth-token-file", default=None, metavar="FILE",
                        help="the router requires a client token from this file (docs/security.md); the "
                        "tokenizer service and workers then require a fresh internal token")


@dataclass(frozen=True)
class ServeSecurity:
    """`serve`'s security flags, checked once; `client` is how serve itself (health checks, the
    demo) reaches its children and router."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    server_name: str | None = None
    auth_token_file: Path | None = None
    client: ChannelSecurity | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def _tls_argv(self) -> list[str]:
        return ["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key)] if self.tls else []

    def backend_argv(self, internal_token: Path | None) -> list[str]:
        """Flags of the tokenizer service and the workers."""
        return self._tls_argv() + (["--internal-token-file", str(internal_token)] if internal_token else [])

    def router_argv(self, internal_token: Path | None) -> list[str]:
        argv = self._tls_argv()
        if self.tls:
            argv += ["--internal-tls-ca", str(self.tls_ca or self.tls_cert)]
            argv += ["--internal-tls-server-name", self.server_name] if self.server_name else []
        argv += ["--auth-token-file", str(self.auth_token_file)] if self.auth_token_file else []
        return argv + (["--internal-token-file", str(internal_token)] if internal_token else [])

    def client_argv(self) -> list[str]:
        """What `llmserve generate/chat` need to reach the router (printed as a hint)."""
        argv = ["--tls-ca", str(self.tls_ca or self.tls_cert)] if self.tls else []
        argv += ["--tls-server-name", self.server_name] if self.server_name else []
        return argv + (["--token-file", str(self.auth_token_file)] if self.auth_token_file else [])


def serve_security_from_args(args: argparse.Namespace) -> ServeSecurity:
    """Loads every file once, so a bad one stops `serve` before any child starts."""
    from llmserve.security import BearerToken, ChannelSecurity, ChannelTls, SecurityConfigError, ServerTls, TokenTable

    cert, key = args.tls_cert, args.tls_key
    if (cert is None) != (key is None):
        missing, given = ("--tls-cert", "--tls-key") if cert is None else ("--tls-key", "--tls-cert")
        raise SecurityConfigError(f"{missing}: needed with {given} (a certificate and its private key)")
    if cert is None and (args.tls_ca or args.tls_server_name):
        raise SecurityConfigError(f"{'--tls-ca' if args.tls_ca else '--tls-server-name'}: needs --tls-cert")
    tls = None
    if cert is not None:
        ServerTls.from_files(cert, key)
        ca_flag = "--tls-ca" if args.tls_ca else "--tls-cert"
        tls = ChannelTls.from_files(args.tls_ca or cert, server_name=args.tls_server_name,
                                    flags=(ca_flag, "--tls-cert", "--tls-key"))
    token = None
    if args.auth_token_file is not None:
        TokenTable.from_file(args.auth_token_file, "--auth-token-file")
        token = BearerToken.from_file(args.auth_token_file, "--auth-token-file")

    def absolute(p: str | None) -> Path | None:
        return Path(p).resolve() if p else None

    return ServeSecurity(absolute(cert), absolute(key), absolute(args.tls_ca), args.tls_server_name or None,
                         absolute(args.auth_token_file), ChannelSecurity(tls, token))
