"""A TCP link on loopback between the run and a real server (moto's S3), which a test can cut or
freeze: the network path failing as it does in the field, while the server keeps its state for the
test to look at afterwards."""
import contextlib
import socket
import threading
from typing import Optional


class FlakyLink:
    """Forwards 127.0.0.1:<port> to upstream. cut(): connections reset and refused, as when the server
    or its host has gone. freeze(): connections stay open and nothing gets through, as when a server
    stops answering or a link is saturated. heal(): as before."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._open = threading.Event()
        self._open.set()
        self._cut = False
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
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self._open.wait()  # frozen: held until healed (or cut)
                if self._cut:
                    break
                target.sendall(data)
        for end in (source, target):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def freeze(self) -> None:
        self._open.clear()

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        self._cut = True
        self._listener.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                connection.close()
        self._open.set()

    def heal(self) -> None:
        if self._cut:
            self._cut = False
            self._listen()
        self._open.set()
