"""The controller client follows a failover at the first failed request: a request that timed out on
a frozen leader (it accepts connections and never answers) goes to the new leader next, not to the
frozen one a second time."""

from __future__ import annotations

import http.server
import json
import socket
import threading

from undying.client import ControllerClient


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"from": "new leader"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_request_that_timed_out_on_a_frozen_leader_goes_to_the_new_one_next() -> None:
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # a frozen controller: takes connections, never answers
        frozen.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(frozen.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    leader = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=leader.serve_forever, daemon=True).start()
    try:
        new_address = f"127.0.0.1:{leader.server_address[1]}"
        client = ControllerClient(f"127.0.0.1:{frozen.getsockname()[1]}", "token", timeout=0.5,
                                  locator=lambda: new_address)
        assert client.post("/agent/poll", {}) == {"from": "new leader"}
        assert client.address == new_address
        assert len(accepted) == 1  # one try on the frozen leader, not two
    finally:
        stop.set()
        leader.shutdown()
        frozen.close()
        for connection in accepted:
            connection.close()
