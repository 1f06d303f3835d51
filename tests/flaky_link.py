"""A TCP link on loopback between the run and a real server (moto's S3), which a test can cut or
freeze: the network path failing as it does in the field, while the server keeps its state for the
test to look at afterwards."""
import contextlib
import socket
import threading
import time
from typing import Callable, Optional


class FlakyLink:
    """Forwards 127.0.0.1:<port> to upstream. cut(): connections reset and refused, as when the server
    or its host has gone. freeze(): connections stay open and nothing gets through, as when a server
    stops answering or a link is saturated. freeze_at(marker): the same, from the moment a request
    holding marker passes (a store that stops answering in a chosen call). refuse(which): a request
    which(request) picks resets its connection (a store that refuses writes, say), the others pass.
    heal(): as before."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._open = threading.Event()
        self._open.set()
        self._cut = False
        self._freeze_at: Optional[bytes] = None
        self.frozen_at: Optional[float] = None
        """When freeze_at's request came (time.monotonic())."""
        self._refused: Optional[Callable[[bytes], bool]] = None
        self.refusals = 0
        """Requests refused so far."""
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: Optional[socket.socket] = None
        self.port = 0
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self.port = self._listener.getsockname()[1]
        self._listener.listen(64)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: cut
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections += [client, server]
            for source, target, requests in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(source, target, requests), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if requests and self._freeze_at is not None and self._freeze_at in data:
                    self._open.clear()
                    self.frozen_at = self.frozen_at or time.monotonic()
                if requests and self._refused is not None and self._refused(data):
                    self.refusals += 1
                    _reset(source)
                    _reset(target)
                    return
                self._open.wait()  # frozen: held until healed (or cut)
                if self._cut:
                    break
                target.sendall(data)
        for end in (source, target):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def freeze(self) -> None:
        self._open.clear()

    def freeze_at(self, marker: bytes) -> None:
        """Freeze once a request holding marker (a key's name, say) comes, before it reaches the server."""
        self._freeze_at = marker

    def refuse(self, which: Optional[Callable[[bytes], bool]]) -> None:
        """Reset the connection of every request which(request) picks (its bytes as they arrive, the
        request line first); None: refuse none."""
        self._refused = which

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        self._cut = True
        with contextlib.suppress(OSError):  # wakes the accept() under way: closing alone leaves it
            self._listener.shutdown(socket.SHUT_RDWR)  # listening, and the port taken, till a client comes
        self._listener.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            _reset(connection)
        self._open.set()

    def heal(self) -> None:
        self._freeze_at = self._refused = None
        if self._cut:
            self._cut = False
            self._listen()
        self._open.set()


def _reset(connection: socket.socket) -> None:
    """Close with a reset (RST), as a dropped connection does."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        connection.close()
