"""A lossy UDP relay between workers and the aggregator (this kernel has no netem).

Workers send to the relay instead of the aggregator; for each worker address the
relay opens its own upstream socket, so the aggregator's answers find their way
back. Every datagram, both directions, is dropped with probability ``loss``,
duplicated with probability ``dup``, and with probability ``reorder`` held back
and sent after the next one. Seeded: a run is reproducible. An upstream socket
idle for ``idle`` seconds is closed (a worker opens a new port for every call).
"""

from __future__ import annotations

import random
import selectors
import socket
import threading
import time

__all__ = ["LossyRelay"]


class LossyRelay:
    """Forward datagrams to ``target`` and back, with injected loss, duplication, reordering."""

    def __init__(self, target: tuple[str, int], loss: float = 0.0, dup: float = 0.0,
                 reorder: float = 0.0, seed: int = 0, idle: float = 30.0) -> None:  # fmt: skip
        for name, v in (("loss", loss), ("dup", dup), ("reorder", reorder)):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
        self.target, self.loss, self.dup, self.reorder = target, loss, dup, reorder
        self.rng = random.Random(seed)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.upstream: dict[tuple[str, int], socket.socket] = {}
        self.client_of: dict[socket.socket, tuple[str, int]] = {}
        self.idle = idle
        self.last_used: dict[tuple[str, int], float] = {}
        self.held: dict[object, tuple[socket.socket, bytes, tuple[str, int]] | None] = {}
        self.counts = {"forwarded": 0, "dropped": 0, "duplicated": 0, "reordered": 0}
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparcml-relay", daemon=True)

    def __enter__(self) -> LossyRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in [self.sock, *self.upstream.values()]:
            s.close()
        self.sel.close()

    def _expire(self, now: float) -> None:
        """Close the upstream sockets of clients idle for ``idle`` seconds."""
        for addr, used in list(self.last_used.items()):
            if now - used > self.idle:
                up = self.upstream.pop(addr)
                del self.last_used[addr], self.client_of[up]
                self.sel.unregister(up)
                up.close()
                for direction in (("up", addr), ("down", addr)):
                    self.held.pop(direction, None)

    def _emit(
        self, direction: object, out: socket.socket, data: bytes, to: tuple[str, int]
    ) -> None:
        r = self.rng.random()
        if r < self.loss:
            self.counts["dropped"] += 1
            return
        if self.held.get(direction) is None and self.rng.random() < self.reorder:
            self.held[direction] = (out, data, to)  # goes out after the next datagram
            self.counts["reordered"] += 1
            return
        copies = 2 if self.rng.random() < self.dup else 1
        self.counts["duplicated"] += copies - 1
        for _ in range(copies):
            out.sendto(data, to)
            self.counts["forwarded"] += 1
        late = self.held.get(direction)
        if late is not None:
            self.held[direction] = None
            late[0].sendto(late[1], late[2])
            self.counts["forwarded"] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    data, addr = s.recvfrom(65535)  # type: ignore[union-attr]
                except OSError:
                    continue
                if s is self.sock:
                    up = self.upstream.get(addr)
                    if up is None:
                        try:
                            up = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                            up.bind(("127.0.0.1", 0))
                        except OSError:  # (out of descriptors: this datagram is lost)
                            self.counts["dropped"] += 1
                            continue
                        self.upstream[addr] = up
                        self.client_of[up] = addr
                        self.sel.register(up, selectors.EVENT_READ)
                    self.last_used[addr] = time.monotonic()
                    self._emit(("up", addr), up, data, self.target)
                else:
                    client = self.client_of.get(s)  # type: ignore[call-overload]
                    if client is None:  # (closed as idle meanwhile)
                        continue
                    self.last_used[client] = time.monotonic()
                    self._emit(("down", client), self.sock, data, client)
            self._expire(time.monotonic())
            # release packets held too long (no next datagram came)
            for direction, late in list(self.held.items()):
                if late is not None and self.rng.random() < 0.5:
                    self.held[direction] = None
                    late[0].sendto(late[1], late[2])
                    self.counts["forwarded"] += 1
