"""Transport security (TLS, mTLS) and bearer-token auth for every llmserve gRPC server and channel.

The model (docs/security.md has the operator's view):

- Every server (router, tokenizer service, worker) listens in plaintext unless given a certificate
  (`--tls-cert` + `--tls-key`); with `--tls-client-ca` as well, it requires a client certificate
  signed by that CA (mTLS) and refuses the TLS handshake of a client without one.
- `--tls-cert` is always the process's *own* certificate, `--tls-ca` the CA it verifies its peer
  with. The router's channels to the tokenizer service and the workers take the same set under
  `--internal-*` (`--internal-tls-ca`, `--internal-tls-cert`/`--internal-tls-key` for mTLS,
  `--internal-tls-server-name`), next to `--internal-token-file`.
- Two kinds of bearer token, both sent as `authorization: Bearer <token>` metadata:
  * client tokens (`llmserve router --auth-token-file`): every Router RPC needs one, except
    grpc.health.v1 (probes and load balancers); reflection sits behind the token too. Each token
    names an identity, which the servicer reads with `current_identity()` (per-client limits).
  * the internal token (`--internal-token-file`, the same file on the router, tokenizer service
    and workers): the router sends it on every internal call; a worker or tokenizer service given
    it refuses every call without it, except the probes a gateway needs (health, model/server
    info, loads; the service passes that list).
  A missing, malformed or unknown token is UNAUTHENTICATED. A known token without the role an RPC
  needs (a method listed as admin-only, e.g. the router's ListWorkers, which shows internal
  addresses) is PERMISSION_DENIED.
- Token file format, one token per line (blank lines and `#` comments skipped):
  `TOKEN [IDENTITY [ROLE,...]]`. A token is 16-4096 visible ASCII characters; the identity
  (default `token-` + 8 hex digits of the token's SHA-256) is a short name for logs and limits;
  the only role is `admin`. A server accepts any token in its file (rotation: list the new and old
  token); a client sends the first.
- Secrets come only from files (paths may be shown; contents never are), are held by servers only
  as SHA-256 digests, compared with `hmac.compare_digest`, and never logged or put in a repr.
- Certificates and keys are read once at start; a missing, unreadable or malformed file, or a key
  that does not match its certificate, is a `SecurityConfigError` naming the flag.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
import re
import secrets
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from llmserve.logging import get_logger

log = get_logger(__name__)

AUTH_METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
ROLES = frozenset({"admin"})
# grpc.health.v1 stays open everywhere: probes and load balancers carry no token.
HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})

_TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP/2 header value may carry
_IDENTITY_RE = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")
_IDENTITY: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmserve_identity", default=None)


class SecurityConfigError(ValueError):
    """A security flag's file is missing, unreadable or malformed; the message starts with the flag."""


def current_identity() -> str | None:
    """The identity of the token that authenticated the current RPC (None when auth is off or the
    method is open). Set by the server interceptor in the context the handler runs in."""
    return _IDENTITY.get()


# ---- files ---------------------------------------------------------------------------------------


def _read(path: str | os.PathLike[str], flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


def _pem(path: str | os.PathLike[str], flag: str, kind: str) -> bytes:
    data = _read(path, flag)
    if f"-----BEGIN {kind}".encode() not in data and not (kind == "PRIVATE KEY" and b"PRIVATE KEY-----" in data):
        raise SecurityConfigError(f"{flag}: {path} holds no PEM {kind.lower()}")
    return data


def _refuse_password() -> bytes:
    raise SecurityConfigError("encrypted private keys are not supported (give an unencrypted PEM key file)")


def _check_pair(cert: str | os.PathLike[str], key: str | os.PathLike[str], cert_flag: str, key_flag: str) -> None:
    """Parse the certificate and key the way TLS will, so a mismatch fails at start, not at the
    first handshake (grpc reports that only as a failed connection)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(str(cert), str(key), password=_refuse_password)
    except SecurityConfigError as exc:
        raise SecurityConfigError(f"{key_flag}: {key}: {exc}") from None
    except ssl.SSLError as exc:
        raise SecurityConfigError(f"{key_flag}: {key} is not the private key of {cert_flag} {cert} "
                                  f"({exc.reason or exc})") from None


def _check_ca(path: str | os.PathLike[str], flag: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise SecurityConfigError(f"{flag}: {path} holds no usable CA certificate ({exc.reason or exc})") from None


# ---- TLS -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM), and the CA its clients' certificates must chain
    to (mTLS) or None."""

    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = field(default=None, repr=False)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    @classmethod
    def from_files(cls, cert: str | os.PathLike[str], key: str | os.PathLike[str],
                   client_ca: str | os.PathLike[str] | None = None, *,
                   flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca")) -> ServerTls:
        cert_flag, key_flag, ca_flag = flags
        chain = _pem(cert, cert_flag, "CERTIFICATE")
        private_key = _pem(key, key_flag, "PRIVATE KEY")
        _check_pair(cert, key, cert_flag, key_flag)
        ca = None
        if client_ca is not None:
            ca = _pem(client_ca, ca_flag, "CERTIFICATE")
            _check_ca(client_ca, ca_flag)
        return cls(chain, private_key, ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ChannelTls:
    """How a client verifies a TLS server: `root_ca` (PEM; None: the system's roots), an optional
    client certificate and key for mTLS, and `server_name` to expect in the server's certificate
    when it differs from the host dialled (e.g. a certificate for a DNS name, dialled by IP)."""

    root_ca: bytes | None = field(default=None, repr=False)
    client_cert: bytes | None = field(default=None, repr=False)
    client_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise SecurityConfigError("a client certificate needs its key and a key its certificate")

    @classmethod
    def from_files(cls, ca: str | os.PathLike[str] | None = None, cert: str | os.PathLike[str] | None = None,
                   key: str | os.PathLike[str] | None = None, server_name: str | None = None, *,
                   flags: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key")) -> ChannelTls:
        ca_flag, cert_flag, key_flag = flags
        if (cert is None) != (key is None):
            raise SecurityConfigError(f"{cert_flag if cert is None else key_flag}: needed with "
                                      f"{key_flag if cert is None else cert_flag} (a client certificate and its key)")
        root = None
        if ca is not None:
            root = _pem(ca, ca_flag, "CERTIFICATE")
            _check_ca(ca, ca_flag)
        chain = private_key = None
        if cert is not None and key is not None:
            chain = _pem(cert, cert_flag, "CERTIFICATE")
            private_key = _pem(key, key_flag, "PRIVATE KEY")
            _check_pair(cert, key, cert_flag, key_flag)
        return cls(root, chain, private_key, server_name or None)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_ca, private_key=self.client_key,
                                            certificate_chain=self.client_cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name), ("grpc.default_authority", self.server_name)]


# ---- tokens --------------------------------------------------------------------------------------


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def _default_identity(token: str) -> str:
    return "token-" + hashlib.sha256(token.encode("ascii")).hexdigest()[:8]


def _check_token(token: str, where: str) -> None:
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise SecurityConfigError(f"{where}: a token must be {MIN_TOKEN_CHARS}-{MAX_TOKEN_CHARS} characters, "
                                  f"got {len(token)}")
    if not _TOKEN_RE.fullmatch(token):
        raise SecurityConfigError(f"{where}: a token may hold only visible ASCII characters")


@dataclass(frozen=True)
class BearerToken:
    """A token a client sends (`authorization: Bearer <value>`). Never shown in a repr."""

    value: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_token(self.value, "token")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], flag: str = "--token-file") -> BearerToken:
        """The first token of a token file (the format of `TokenTable.from_file`)."""
        return cls(_parse_token_lines(path, flag)[0][0])

    def metadata(self) -> tuple[str, str]:
        return (AUTH_METADATA_KEY, f"Bearer {self.value}")


def write_new_token(path: str | os.PathLike[str]) -> Path:
    """A fresh random token in a new file only its owner can read (`serve`'s internal token)."""
    target = Path(path)
    target.unlink(missing_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return target


@dataclass(frozen=True)
class TokenEntry:
    identity: str
    digest: bytes = field(repr=False)
    roles: frozenset[str] = frozenset()


def _parse_token_lines(path: str | os.PathLike[str], flag: str) -> list[tuple[str, str, frozenset[str]]]:
    raw = _read(path, flag)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SecurityConfigError(f"{flag}: {path} is not an ASCII text file") from None
    out: list[tuple[str, str, frozenset[str]]] = []
    seen: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{flag}: {path} line {number}"  # never the line itself: it holds the secret
        fields = line.split()
        if len(fields) > 3:
            raise SecurityConfigError(f"{where}: expected `TOKEN [IDENTITY [ROLE,...]]`, got {len(fields)} fields")
        token = fields[0]
        _check_token(token, where)
        identity = fields[1] if len(fields) > 1 else _default_identity(token)
        if not _IDENTITY_RE.fullmatch(identity):
            raise SecurityConfigError(f"{where}: the identity must be 1-128 of [A-Za-z0-9._:@/+-]")
        roles = frozenset(r for r in fields[2].split(",") if r) if len(fields) > 2 else frozenset()
        if roles - ROLES:
            raise SecurityConfigError(f"{where}: unknown role(s) {', '.join(sorted(roles - ROLES))}; "
                                      f"known: {', '.join(sorted(ROLES))}")
        digest = _digest(token)
        if digest in seen:
            raise SecurityConfigError(f"{where}: the same token as line {seen[digest]}")
        seen[digest] = number
        out.append((token, identity, roles))
    if not out:
        raise SecurityConfigError(f"{flag}: {path} holds no token")
    try:
        if Path(path).stat().st_mode & 0o077:
            log.warning("token file is readable by other users; chmod 600 it", flag=flag, path=str(path))
    except OSError:
        pass
    return out


@dataclass(frozen=True)
class TokenTable:
    """The tokens a server accepts, held as SHA-256 digests with their identity and roles."""

    entries: tuple[TokenEntry, ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise SecurityConfigError("a token table needs at least one token")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], flag: str) -> TokenTable:
        return cls(tuple(TokenEntry(identity, _digest(token), roles)
                         for token, identity, roles in _parse_token_lines(path, flag)))

    @classmethod
    def of(cls, tokens: Iterable[str | tuple[str, str] | tuple[str, str, Iterable[str]]]) -> TokenTable:
        """For library users and tests: tokens, (token, identity) or (token, identity, roles)."""
        entries = []
        for item in tokens:
            token, identity, roles = (item, "", ()) if isinstance(item, str) else (*item, ())[:3]
            _check_token(token, "token")
            entries.append(TokenEntry(identity or _default_identity(token), _digest(token), frozenset(roles)))
        return cls(tuple(entries))

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry whose token this is, comparing digests in constant time over every entry."""
        try:
            digest = hashlib.sha256(token.encode("ascii")).digest()
        except UnicodeEncodeError:
            return None
        found = None
        for entry in self.entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found


# ---- server side ---------------------------------------------------------------------------------


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            text = value if isinstance(value, str) else bytes(value).decode("ascii", errors="replace")
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `code` (requests are not
    deserialized)."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a token from `tokens` (UNAUTHENTICATED), and calls to `admin_methods`
    with a token lacking the admin role (PERMISSION_DENIED); `open_methods` pass untouched. The
    caller's identity is set for `current_identity()` in the context the handler runs in."""

    def __init__(self, tokens: TokenTable, open_methods: Iterable[str] = HEALTH_METHODS,
                 admin_methods: Iterable[str] = (), realm: str = "llmserve") -> None:
        self._tokens = tokens
        self._open = frozenset(open_methods)
        self._admin = frozenset(admin_methods)
        self._realm = realm

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        if method in self._open:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, as without auth
        token = _bearer(handler_call_details.invocation_metadata)
        entry = self._tokens.lookup(token) if token else None
        if entry is None:
            reason = "missing" if token is None else "malformed" if not token else "invalid"
            log.info("call refused", rpc=method, reason=f"{reason} bearer token", code="UNAUTHENTICATED")
            hint = "" if reason == "invalid" else " (send metadata `authorization: Bearer <token>`)"
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            f"{self._realm}: {reason} bearer token{hint}")
        if method in self._admin and "admin" not in entry.roles:
            log.info("call refused", rpc=method, identity=entry.identity, reason="not an admin token",
                     code="PERMISSION_DENIED")
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            f"{self._realm}: {method.rsplit('/', 1)[-1]} needs a token with the admin role "
                            f"(identity {entry.identity} has none)")
        _IDENTITY.set(entry.identity)
        return handler


@dataclass(frozen=True)
class ServerSecurity:
    """What one server needs: TLS (None: plaintext) and the tokens its callers must present (None:
    no auth)."""

    tls: ServerTls | None = None
    tokens: TokenTable | None = None

    def interceptors(self, open_methods: Iterable[str] = HEALTH_METHODS, admin_methods: Iterable[str] = (),
                     realm: str = "llmserve") -> list[grpc.aio.ServerInterceptor]:
        if self.tokens is None:
            return []
        return [BearerAuthInterceptor(self.tokens, open_methods, admin_methods, realm)]


# ---- client side ---------------------------------------------------------------------------------


class _AddBearer:
    """Adds `authorization: Bearer <token>` to a grpc.aio call's metadata."""

    def __init__(self, token: BearerToken) -> None:
        self._pair = token.metadata()

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files an interceptor under the first of the four kinds it is, so each kind is its own class.
class _BearerUnaryUnary(_AddBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerUnaryStream(_AddBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerStreamUnary(_AddBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _BearerStreamStream(_AddBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def _bearer_interceptors(token: BearerToken) -> list[grpc.aio.ClientInterceptor]:
    return [kind(token) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary, _BearerStreamStream)]


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a server: TLS (None: plaintext) and the token it sends (None: none)."""

    tls: ChannelTls | None = None
    token: BearerToken | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata for clients that add it themselves (the blocking RouterClient)."""
        return (self.token.metadata(),) if self.token is not None else ()

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel that uses TLS when configured and sends the token on every call."""
        interceptors = _bearer_interceptors(self.token) if self.token is not None else None
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        return grpc.aio.secure_channel(address, self.tls.credentials(),
                                       options=list(options) + self.tls.channel_options(), interceptors=interceptors)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (TLS when configured). It does not add the token: callers pass
        `metadata()` per call, or use it for the open methods (health)."""
        if self.tls is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.tls.credentials(), options=list(options) + self.tls.channel_options())
