"""The IPC channel between the front end (``core_client.py``) and the engine process
(``core_proc.py``): where its two sockets are, and who may speak on them.

The sockets are files in a 0700 directory, which keeps other users out but not other
processes of the same uid: without more, any of them could connect, have the front end
unpickle what it sends, or take queued ``Add`` commands (a PUSH socket deals its messages
round robin to whoever is connected). So the channel is ZeroMQ CURVE with keys made for one
front end: its sockets are CURVE servers, and a ZAP handler on its context admits one client
key, the engine process's. The engine gets its keys on its stdin pipe (never in argv or the
environment, which ``/proc`` shows). A peer without them fails the handshake before libzmq
attaches it to the socket, so nothing it sends is ever received, let alone unpickled, and no
command is routed to it; and the engine, as the CURVE client, checks the server's key, so a
socket file that someone else put in the directory is not trusted either.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, replace

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("kvgate.engine")


@dataclass(frozen=True)
class ChannelKeys:
    """CURVE keys (Z85, 40 bytes each) of one front end and its engine process."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @staticmethod
    def new() -> ChannelKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return ChannelKeys(server_public, server_secret, client_public, client_secret)

    def engine_side(self) -> ChannelKeys:
        """What the engine process gets: its own pair and the server's public key."""
        return replace(self, server_secret=b"")


@dataclass(frozen=True)
class Channel:
    """``directory``: the sockets' directory (0700), which the engine process removes if it
    outlives the front end; ``front_pid``: the front end, whose end the engine watches."""

    directory: str
    keys: ChannelKeys
    front_pid: int

    @property
    def commands(self) -> str:
        return f"ipc://{self.directory}/commands"

    @property
    def results(self) -> str:
        return f"ipc://{self.directory}/results"

    def engine_side(self) -> Channel:
        return replace(self, keys=self.keys.engine_side())


def serve_secured(socket: zmq.Socket[bytes], keys: ChannelKeys) -> None:
    """Make ``socket`` (the front end's, before it binds) a CURVE server."""
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True


def connect_secured(socket: zmq.Socket[bytes], keys: ChannelKeys) -> None:
    """Make ``socket`` (the engine's, before it connects) a CURVE client of the front end."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


class Gate:
    """The ZAP handler of the front end's context: admits the engine's key, no other. Start
    it before the sockets bind (libzmq asks it at every CURVE handshake)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: ChannelKeys) -> None:
        self._allowed = keys.client_public
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("kvgate.engine.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """``ThreadAuthenticator``'s question: may the client with this (Z85) key in?"""
        allowed = hmac.compare_digest(key, self._allowed)
        if not allowed:
            log.warning("refused a connection to the engine channel: not the engine's key")
        return allowed

    def stop(self) -> None:
        self._auth.stop()
