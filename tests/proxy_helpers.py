"""Shared by the proxy's tests and bench: `python proxy.py` as a subprocess, and a stdlib client."""

import http.client
import json
import os
import signal
import subprocess
import sys

from conftest import KEY, ROOT, clean_env

JSON = {"Content-Type": "application/json"}  # what every real client sends with a body


class Proxy:
    """`python proxy.py --listen 127.0.0.1:0 ...` against `base_url`; the port from its first stdout line."""

    def __init__(self, base_url, ledger, *args, **env):
        self.ledger = ledger
        environ = clean_env(BASE_URL=base_url, API_KEY=env.pop("API_KEY", KEY), **env)
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "proxy.py"), "--listen", "127.0.0.1:0",
                                      "--ledger", str(ledger), *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)
        self.first_line = self.proc.stdout.readline().decode()
        if not self.first_line:
            self.proc.wait(30)
            raise RuntimeError("the proxy did not start: " + self.proc.stderr.read().decode())
        self.port = int(self.first_line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Stop it (sig None: wait for it to exit); returns (exit code, rest of stdout, stderr)."""
        if sig is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out.decode(), err.decode()


def post(conn, path, body, headers=None):
    """One request on `conn`; returns (response, body bytes), the body read to its end."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", "/v1" + path, body=data, headers=dict({"Content-Type": "application/json", "User-Agent": "test-client/1"},
                                                                **(headers or {})))
    response = conn.getresponse()
    return response, response.read()


def events(raw):
    """The SSE events of a body, split at blank lines."""
    return [e for e in raw.decode().split("\n\n") if e.strip()]
