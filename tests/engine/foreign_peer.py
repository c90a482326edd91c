"""A foreign process on the engine channel (``kvgate/engine/channel.py``): it connects to
one of the front end's sockets as the engine would (PUSH to ``results``, PULL from
``commands``), with no CURVE keys, or with a server key and a pair of its own; on
``results`` it sends a pickle that creates ``marker`` if the front end unpickles it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import TracebackType

SCRIPT = r"""
import pickle, sys, zmq
from zmq.utils.monitor import recv_monitor_message

address, role, server_key, marker = sys.argv[1:5]
context = zmq.Context()
sock = context.socket(zmq.PUSH if role == "results" else zmq.PULL)
if server_key != "-":
    sock.curve_serverkey = server_key.encode()
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
monitor = sock.get_monitor_socket()
sock.connect(address)


class Payload:
    def __reduce__(self):
        return (open, (marker, "w"))


if role == "results":  # queued: goes out as soon as a handshake succeeds
    sock.send(pickle.dumps(("snap", Payload())))
ends = {zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
outcome = "none"
while monitor.poll(120_000):
    event = recv_monitor_message(monitor)["event"]
    if event in ends:
        outcome = zmq.Event(event).name
        break
print(outcome, flush=True)
sys.stdin.readline()
received = 0
while sock.poll(0):
    sock.recv()
    received += 1
print(received, flush=True)
"""


class ForeignPeer:
    """``with ForeignPeer(...) as peer``: ``peer.outcome()`` (how its first handshake ended,
    a ``zmq.Event`` name), then ``peer.received()`` (the commands it got until then)."""

    def __init__(self, socket_dir: str | Path, role: str, server_key: bytes | None, marker: Path):
        key = server_key.decode() if server_key is not None else "-"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, f"ipc://{socket_dir}/{role}", role, key, str(marker)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def outcome(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def received(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def __enter__(self) -> ForeignPeer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
