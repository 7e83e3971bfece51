"""The daemon's holes of issue 16: a signed body counts once whatever event it claims, and only Host values
naming the listening address (or --allow-host) are answered, on every route."""

import json
import socket

import pytest

from test_daemon import github_headers, raw_exchange, request, serve, verifies  # noqa: F401


# ----------------------------------------------------------------------------
# 8. Every signed body is remembered, whatever its event
# ----------------------------------------------------------------------------

def test_a_captured_ping_body_replayed_as_a_push_under_a_new_id_starts_no_run(serve):
    daemon = serve()
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1, "after": "0" * 40}).encode()
    ping = daemon.post(body, github_headers(body, delivery="ping-1", event="ping"))
    assert ping.status == 200 and ping.json()["run_id"] is None
    forged = daemon.post(body, github_headers(body, delivery="forged-push-1", event="push"))
    assert forged.status == 200 and forged.json()["run_id"] is None and forged.json()["duplicate"] is True
    assert daemon.stop() == 0
    daemon = serve()  # remembered across a restart too
    again = daemon.post(body, github_headers(body, delivery="forged-push-2", event="push"))
    assert again.status == 200 and again.json()["run_id"] is None
    assert daemon.payloads("run_dispatched") == [] and len(daemon.payloads("webhook_received")) == 1
    same = [p["same_body_as"] for p in daemon.payloads("webhook_duplicate")]
    assert same == ["ping-1", "ping-1"]
    assert daemon.stop() == 0
    verifies(serve.runs)


# ----------------------------------------------------------------------------
# 9. Host and Origin
# ----------------------------------------------------------------------------

def _raw(port, method, path, host=None, extra=b"", body=b""):
    head = f"{method} {path} HTTP/1.1\r\n".encode()
    if host is not None:
        head += f"Host: {host}\r\n".encode()
    head += extra + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    return raw_exchange(port, head + body)


ROUTES = [("POST", "/webhook"), ("GET", "/runs"), ("GET", "/healthz"), ("GET", "/runs/x"), ("GET", "/nowhere")]


@pytest.mark.parametrize("method,path", ROUTES)
def test_a_host_that_does_not_name_the_listening_address_is_refused_on_every_route(serve, method, path):
    daemon = serve(secret_file=False)  # loopback, no secret, no token: the setting a rebinding page aims at
    body = b'{"after": "0000000000000000000000000000000000000000"}' if method == "POST" else b""
    ctype = b"Content-Type: application/json\r\n" if body else b""
    for host in ("rebind.attacker.example", f"rebind.attacker.example:{daemon.port}", "127.0.0.1.attacker.example"):
        status, got = _raw(daemon.port, method, path, host, ctype, body)
        assert status == 421, (host, got)
    for origin in (b"http://rebind.attacker.example", b"null"):
        status, got = _raw(daemon.port, method, path, f"127.0.0.1:{daemon.port}", ctype + b"Origin: " + origin +
                           b"\r\n", body)
        assert status == 403, (origin, got)
    assert daemon.payloads("webhook_received") == [] and daemon.payloads("run_dispatched") == []
    for host in (f"127.0.0.1:{daemon.port}", "127.0.0.1", f"localhost:{daemon.port}", "LOCALHOST."):
        status, got = _raw(daemon.port, "GET", "/healthz", host,
                           f"Origin: http://127.0.0.1:{daemon.port}\r\n".encode())
        assert status == 200, (host, got)
    assert daemon.stop() == 0


def test_allow_host_names_the_extra_host_values_answered(serve):
    daemon = serve("--allow-host", "agent.internal.example", "--allow-host", "hooks.example.org", secret_file=False)
    for host in ("agent.internal.example", "HOOKS.example.org:443"):
        status, got = _raw(daemon.port, "GET", "/runs", host)
        assert status == 200, (host, got)
    status, _got = _raw(daemon.port, "GET", "/runs", "other.example.org")
    assert status == 421
    started = daemon.payloads("daemon_started")[0]
    assert started["allow_hosts"] == ["agent.internal.example", "hooks.example.org"]
    assert daemon.stop() == 0


def test_a_client_that_sends_no_host_is_not_a_browser_and_is_answered(serve):
    daemon = serve(secret_file=False)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200 ") or got.startswith(b"HTTP/1.0 200 "), got
    assert request(daemon.port, "GET", "/runs").status == 200  # http.client names the address
    assert daemon.stop() == 0
