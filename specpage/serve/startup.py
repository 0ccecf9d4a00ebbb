"""Checks the daemon makes before it loads the models, so that a taken port or
a bad TLS file fails in seconds with one clear line, not minutes later with a
traceback (under ``Restart=on-failure``, a crash loop that reloads the models
each time)."""

from __future__ import annotations

import socket
import ssl

import grpc


class StartupError(Exception):
    """The daemon cannot start; the message says what to fix, in one line."""


def check_port_free(what: str, host: str, port: int) -> None:
    """Bind every address host:port resolves to once, and give it back.

    gRPC's C core logs its own line when a bind fails and then raises an error
    that does not say why; this finds the reason first ("Address already in
    use"). A port taken between the check and the real bind still fails there.
    """
    if port == 0:
        return  # any free port: nothing can be taken
    bare = host.removeprefix("[").removesuffix("]")  # "[::1]" is gRPC's spelling
    try:
        addresses = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise StartupError(f"{what} address {host}:{port}: {error.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As the real listeners do, so that connections in TIME_WAIT do not count.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                raise StartupError(
                    f"{what} port {port} on {host}: {error.strerror}") from None


def tls_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """Server credentials from PEM files, checked to be a certificate and its key."""
    pem = {}
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            with open(path, "rb") as file:
                pem[name] = file.read()
        except OSError as error:
            raise StartupError(f"server.{name}: cannot read {path}: {error.strerror}") from None
    try:
        # gRPC takes any bytes here and fails only at the first handshake.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as error:
        raise StartupError(
            f"server.tls_cert {cert} and server.tls_key {key} are not a PEM certificate "
            f"and its private key: {error.reason or error}") from None
    return grpc.ssl_server_credentials([(pem["tls_key"], pem["tls_cert"])])
