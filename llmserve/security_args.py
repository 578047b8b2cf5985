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
