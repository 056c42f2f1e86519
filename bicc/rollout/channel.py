"""The control line between the trainer and its rollout workers: ordered messages through a ``torch.distributed``
``TCPStore`` that trainer rank 0 serves (``serve``) and every worker joins (``connect``), on this node or another.

Each direction of each worker is a ``Channel``: message k is the store key ``<name>/<k>``, written once by its one
sender and deleted by its one reader, so messages arrive in the order sent and the store holds only those not yet
read. A message is a kind, a few JSON fields and optional bytes (a batch saved by ``torch.save``, read back with
``weights_only``): nothing on the line is unpickled. The weights themselves never travel here
(``bicc.rollout.weight_sync``).

A store client whose server has gone (the trainer died, SIGKILL included) fails its next call at once, which is how a
worker learns that its trainer is gone (``bicc.rollout.worker``).
"""

from __future__ import annotations

import datetime
import json
import struct
import time
from dataclasses import dataclass, field

import torch.distributed as dist

POLL_S = 0.005  # the longest pause between two looks at the store while waiting (a look costs ~0.1 ms)


def serve(port: int, timeout_s: float) -> dist.TCPStore:
    """The store rank 0 serves on ``port`` of every interface (0: a free one, read back from ``.port``)."""
    return dist.TCPStore("0.0.0.0", port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rollout worker: --connect {address!r} is not host:port")
    return dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s))


@dataclass
class Message:
    kind: str
    fields: dict = field(default_factory=dict)
    payload: bytes = b""

    def __getitem__(self, key: str):
        return self.fields[key]


def encode(message: Message) -> bytes:
    head = json.dumps({"kind": message.kind, **message.fields}).encode()
    return struct.pack("<Q", len(head)) + head + message.payload


def decode(data: bytes) -> Message:
    (n,) = struct.unpack("<Q", data[:8])
    fields = json.loads(data[8 : 8 + n].decode())
    return Message(fields.pop("kind"), fields, bytes(data[8 + n :]))


class Channel:
    """One direction of one worker's line: ``send`` on one side, ``poll``/``receive`` on the other."""

    def __init__(self, store: dist.Store, name: str):
        self.store, self.name = store, name
        self.sent = self.read = 0

    def send(self, kind: str, payload: bytes = b"", **fields) -> None:
        self.sent += 1
        self.store.set(f"{self.name}/{self.sent}", encode(Message(kind, fields, payload)))

    def pending(self) -> bool:
        """Whether a message sent here has not been read yet."""
        return self.sent > 0 and self.store.check([f"{self.name}/{self.sent}"])

    def poll(self) -> Message | None:
        """The next message if it has arrived, else None (never waits)."""
        key = f"{self.name}/{self.read + 1}"
        if not self.store.check([key]):
            return None
        return self._take(key)

    def receive(self, timeout_s: float) -> Message | None:
        """The next message, waiting up to ``timeout_s``; None if none came. It polls (1 ms at first, backing off
        to ``POLL_S``): the store's own timed wait logs a warning at every timeout."""
        deadline, pause = time.monotonic() + timeout_s, 0.001
        while True:
            message = self.poll()
            if message is not None or time.monotonic() >= deadline:
                return message
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)

    def _take(self, key: str) -> Message:
        data = self.store.get(key)
        self.store.delete_key(key)
        self.read += 1
        return decode(data)


def to_worker(store, index: int) -> Channel:
    return Channel(store, f"line/to/{index}")


def from_worker(store, index: int) -> Channel:
    return Channel(store, f"line/from/{index}")
