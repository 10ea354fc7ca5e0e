"""The TLS of ``transport_compare.py``'s encrypted candidates: a throwaway CA, the contexts.

* ``make_certs``: a throwaway CA and a server certificate for ``localhost`` and ``127.0.0.1``
  (P-256 keys, made by the ``openssl`` command line, as ``tests/cluster/test_transport.py``'s
  ``certs`` fixture does), in a directory that ``transport_compare.py`` makes and removes;
* ``server_context`` / ``client_context``: Python's ``ssl`` (OpenSSL), TLS 1.3 only, for
  ``tcp-tls`` and ``asyncio-uvloop-tls``; the client trusts the CA alone and checks the
  host name (127.0.0.1: the certificate's SAN IP);
* ``grpc_server_credentials`` / ``grpc_channel_credentials``: the same files for
  ``grpc-stream-tls`` (gRPC's own TLS, BoringSSL).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

TLS = ("tcp-tls", "grpc-stream-tls", "asyncio-uvloop-tls")
HOST = "127.0.0.1"
KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def has_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                   timeout=60)


def make_certs(directory: Path) -> Path:
    """``ca.pem``, ``server.pem`` and ``server.key`` in ``directory``; returns it."""
    _openssl(directory, "req", "-x509", *KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days",
             "2", "-subj", "/CN=bench-ca")
    _openssl(directory, "req", *KEY, "-keyout", "server.key", "-out", "server.csr", "-subj",
             "/CN=bench-server")
    (directory / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(directory, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey",
             "ca.key", "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile",
             "server.ext")
    return directory


def server_context(certs: Path):  # noqa: ANN201 - an ssl.SSLContext
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(certs / "server.pem", certs / "server.key")
    return context


def client_context(certs: Path):  # noqa: ANN201 - an ssl.SSLContext
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname, CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(certs / "ca.pem")
    return context


def grpc_server_credentials(certs: Path):  # noqa: ANN201 - grpc.ServerCredentials
    import grpc

    return grpc.ssl_server_credentials([((certs / "server.key").read_bytes(),
                                         (certs / "server.pem").read_bytes())])


def grpc_channel_credentials(certs: Path):  # noqa: ANN201 - grpc.ChannelCredentials
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
