"""Test PKI made at test time with the openssl CLI: a CA, a server certificate for 127.0.0.1 /
localhost and a client certificate, plus a second CA that signed nothing the servers trust."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an unrelated CA: a client certificate signed by it is not trusted
    other_client_cert: Path
    other_client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    key, csr, cert, extfile = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    extfile.write_text(f"basicConstraints=CA:FALSE\n{ext}\n")
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
         "-out", str(csr), "-subj", f"/CN={name}", cwd=d)
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-out", str(cert), "-days", "2", "-extfile", str(extfile), cwd=d)
    return cert, key


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "test-ca")
    other = _ca(d, "other-ca")
    server = _leaf(d, "server", ca, "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    client = _leaf(d, "client", ca, "extendedKeyUsage=clientAuth")
    stranger = _leaf(d, "stranger", other, "extendedKeyUsage=clientAuth")
    return Pki(ca[0], server[0], server[1], client[0], client[1], other[0], stranger[0], stranger[1])
