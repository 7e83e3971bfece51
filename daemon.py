#!/usr/bin/env python3
"""daemon.py -- webhooks start agent runs: a signed delivery is recorded, queued, and run by
`agent.py run`, one at a time; the runs and their timelines are served read-only.

Usage:
  WEBHOOK_SECRET=... python3 daemon.py --repo DIR [--host H] [--port P] [--runs-dir DIR]

A body is authenticated before it is parsed, an accepted delivery is in RUNS/daemon.jsonl before
the answer, and each run is a child `agent.py run` in its own process group. Settings: BASE_URL,
API_KEY, MODEL_ID as for ask.py; WEBHOOK_SECRET or WEBHOOK_SECRET_FILE; READ_TOKEN for the pages.
Exit codes: 0 stopped by SIGTERM or SIGINT, 1 the daemon failed, 2 usage or configuration error.
See docs/daemon.md.
"""

import argparse
import base64
import binascii
import collections
import contextlib
import email.utils
import hashlib
import hmac
import html
import itertools
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# the toolkit beside us, even under -I
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agent  # noqa: E402
import ask  # noqa: E402
import fleet  # noqa: E402
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"
__all__ = ["Daemon", "serve_settings", "main"]

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

DAEMON_LEDGER = "daemon.jsonl"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Standard Webhooks: a webhook-timestamp more than 5 minutes off is refused
SIGNATURE_TOLERANCE_S = 300
KILL_MARGIN_S = 60  # a run is killed after max_wall_s + 2 x test_timeout_s + this
TERMINATE_WAIT_S = 5  # SIGTERM to a run's process group, then SIGKILL this much later
RESPONSE_GRACE_S = 2  # an answer is written within this much after the request's deadline
# after an error answered before the body was read, unread input is drained this long
LINGER_S = 1.0
LINGER_BYTES = 64 * 1024  # and at most this much of it
MAX_SECRETS_FILE = 64 * 1024  # WEBHOOK_SECRET_FILE holds a few secrets, not a log
RETRY_AFTER_S = 30  # a full queue asks the sender to come back after this
# connections over the cap: at most one connection_limit event this often
CONNECTION_EVENT_EVERY_S = 10
MAX_SIGNATURES = 16  # webhook-signature entries looked at
MAX_EVENTS_SHOWN = 5000  # GET /runs/<id> shows at most this many events
MAX_SHOWN_CHARS = 4000  # one value on the timeline page
# the model's keys and the ledger key reach a run on its stdin, not in its environment; the
# daemon's own secrets never reach it
PIPED_ENV, DAEMON_ENV = rl.SECRET_ENV_VARS[:3], rl.SECRET_ENV_VARS[3:6]
_BUSY = ask.http_answer(
    503, b'{"error": "too many connections; retry later"}\n', [("Retry-After", "1")], close=True
)
# what an answer says besides its body
_HEADERS = {
    "Server": "agent.py-serve",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff"
}
_METHODS = "GET POST PUT DELETE PATCH HEAD OPTIONS TRACE CONNECT".split()  # others: 501

_DELIVERY_RE = rl.RUN_ID_RE  # a delivery id has the shape of a run id
_EVENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}\Z")
_GITHUB_SIG_RE = re.compile(r"sha256=([0-9a-fA-F]{64})\Z")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?\Z")
# new_run_id()'s shape only
_RUN_URL_RE = re.compile(r"/runs/([0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{8})\Z")
# a run's files, by the names its ledger gives them: the proposal and the artifacts
_FILE_RE = re.compile(r"proposal\.patch|artifacts/[0-9a-f]{64}")
_FILE_URL_RE = re.compile(_RUN_URL_RE.pattern[:-2] + "/(" + _FILE_RE.pattern + r")\Z")
MAX_FILE_BYTES = 16 << 20  # GET /runs/<id>/<file> serves at most this much of a file
Refused = ask.Refused

# github, standard or unsigned; id; event
Delivery = collections.namedtuple("Delivery", "source delivery event")


def serve_settings(args, environ):
    """The daemon's settings, from `serve`'s arguments and the environment; a bad one raises
    UsageError."""
    for name in ("max_body", "queue", "max_connections"):
        if getattr(args, name) < 1:
            raise rl.UsageError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("request_timeout", "kill_after_s"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < float("inf"):
            raise rl.UsageError(f"--{name.replace('_', '-')} must be a positive number")
    if not 0 <= args.grace_s < float("inf"):
        raise rl.UsageError("--grace-s must be zero or more")
    if not 0 <= args.port <= 65535:
        raise rl.UsageError("--port must be between 0 and 65535")
    secrets = webhook_secrets(environ)
    # every run needs them: refuse to start without
    api_key = ask.settings_from_env(environ=environ)[2]
    token = args.read_token or environ.get("READ_TOKEN") or None
    if token is not None and len(token) < 16:
        raise rl.UsageError(
            "the read token (--read-token / READ_TOKEN) must be at least 16 characters"
        )
    loopback = ask.is_loopback(args.host)
    if not loopback and not secrets:
        raise rl.UsageError(
            f"refusing to listen on {rl.printable(args.host)}, which is not a loopback address, "
            f"without a webhook secret: set WEBHOOK_SECRET or WEBHOOK_SECRET_FILE"
        )
    allow = [name.strip().lower().rstrip(".") for name in args.allow_host or ()]
    if args.ship_to:
        fleet.ClickHouse(args.ship_to)  # the URL's form is checked now, not once per run
    policy = agent.load_policy(Path(args.tools).resolve())
    names = (
        set(allow)
        | {args.host.strip("[]").lower()}
        | ({"localhost", "127.0.0.1", "::1"} if loopback else set())
    )
    return argparse.Namespace(
        **dict(
            vars(args),
            repo=agent.repo_root(args.repo),
            tools=Path(args.tools).resolve(),
            policy=policy,
            allow_hosts=allow,
            runs_dir=Path(args.runs_dir).resolve(),
            names=names,
            keys=signing_keys(secrets),
            read_token=token,
            token_required=bool(token) or not loopback,
            secrets=[s for s in secrets + [token, api_key] if s],
            kill_after_s=float(
                args.kill_after_s
                or policy.budget["max_wall_s"] + 2 * policy.test_timeout_s + KILL_MARGIN_S
            )
        )
    )


def webhook_secrets(environ=None):
    """WEBHOOK_SECRET and the lines of WEBHOOK_SECRET_FILE (blank ones ignored): several serve a
    rotation."""
    env = os.environ if environ is None else environ
    secrets = [env["WEBHOOK_SECRET"]] if env.get("WEBHOOK_SECRET") else []
    if env.get("WEBHOOK_SECRET_FILE"):
        try:
            with open(env["WEBHOOK_SECRET_FILE"], "rb") as handle:
                # /dev/zero, or a log named by mistake, is refused
                raw = handle.read(MAX_SECRETS_FILE + 1)
            lines = raw.decode("utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise rl.UsageError(f"WEBHOOK_SECRET_FILE: {rl.error_text(exc)}") from None
        if len(raw) > MAX_SECRETS_FILE:
            raise rl.UsageError(f"WEBHOOK_SECRET_FILE: larger than {MAX_SECRETS_FILE} bytes")
        found = [line.rstrip("\r") for line in lines if line.strip()]
        if not found:
            raise rl.UsageError("WEBHOOK_SECRET_FILE: holds no secret (one secret a line)")
        secrets += found
    return secrets


def signing_keys(secrets):
    """[(GitHub key, Standard Webhooks key: a `whsec_<base64>` secret's decoded bytes)] for each
    secret."""
    keys = []
    for secret in secrets:
        if len(secret) < rl.MIN_SECRET_CHARS:  # too short to mask by value, and to resist guessing
            raise rl.UsageError(
                f"a webhook secret must be at least {rl.MIN_SECRET_CHARS} characters"
            )
        raw = standard = secret.encode("utf-8")
        if secret.startswith("whsec_"):
            try:
                standard = base64.b64decode(secret[6:], validate=True)
            except (binascii.Error, ValueError):
                raise rl.UsageError(
                    "a whsec_ webhook secret must be base64 after the prefix "
                    "(the secret is not shown)"
                ) from None
        keys.append((raw, standard))
    return keys


# -- authentication: before the body is parsed ---------------------------------


def _signed(keys, message, given, encode=bytes):
    """Is one of `given` the HMAC-SHA256 of `message` under one of `keys`? Every pair compared in
    constant time."""
    matched = False
    for key in keys:
        digest = encode(hmac.new(key, message, hashlib.sha256).digest())
        for value in given:
            matched |= hmac.compare_digest(digest, value)
    return matched


def verify_github(keys, body, header):
    """X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, raw body)>, against every secret. Raises
    Refused."""
    match = _GITHUB_SIG_RE.match(header or "")
    if not match:
        raise Refused(401, "bad_signature_format", "the signature does not match")
    if not _signed([raw for raw, _s in keys], body, [bytes.fromhex(match[1])]):
        raise Refused(401, "bad_signature", "the signature does not match")


def verify_standard(keys, body, msg_id, timestamp, header, now=None):
    """Standard Webhooks: `v1,<base64 HMAC-SHA256 of id.timestamp.body>` entries, a timestamp
    within 5 minutes."""
    if not msg_id or not timestamp or not header:
        raise Refused(
            401,
            "missing_signature",
            "webhook-id, webhook-timestamp and webhook-signature are required"
        )
    if not re.fullmatch(r"[0-9]{1,12}", timestamp.strip()):
        raise Refused(401, "bad_timestamp", "webhook-timestamp must be Unix seconds")
    if abs((time.time() if now is None else now) - int(timestamp)) > SIGNATURE_TOLERANCE_S:
        raise Refused(401, "stale_timestamp", "webhook-timestamp is outside the tolerance")
    given = [
        entry[3:].encode("latin-1")
        for entry in header.split()[:MAX_SIGNATURES]
        if entry.startswith("v1,")
    ]
    if not _signed(
        [standard for _g, standard in keys],
        f"{msg_id}.{timestamp}.".encode("latin-1") + body,
        given,
        base64.b64encode
    ):
        raise Refused(401, "bad_signature", "the signature does not match")


def authenticate(keys, headers, body, now=None):
    """The Delivery: which scheme signed the raw body, its id and event name. Raises Refused."""
    if not keys:  # only on loopback: nothing to check against
        delivery = (
            headers.get("X-GitHub-Delivery")
            or headers.get("webhook-id")
            or f"local-{os.urandom(8).hex()}"
        )
        found = Delivery("unsigned", delivery.strip(), headers.get("X-GitHub-Event"))
    elif headers.get("X-Hub-Signature-256") is not None:
        verify_github(keys, body, headers.get("X-Hub-Signature-256").strip())
        for name, reason in (
            ("X-GitHub-Delivery", "missing_delivery"),
            ("X-GitHub-Event", "missing_event")
        ):
            if not headers.get(name):
                raise Refused(400, reason, f"{name} is required")
        found = Delivery(
            "github",
            headers.get("X-GitHub-Delivery").strip(),
            headers.get("X-GitHub-Event").strip()
        )
    elif headers.get("webhook-signature") is not None:
        msg_id = headers.get("webhook-id")
        verify_standard(
            keys,
            body,
            msg_id,
            headers.get("webhook-timestamp"),
            headers.get("webhook-signature"),
            now
        )
        found = Delivery("standard", msg_id.strip(), None)
    else:
        raise Refused(
            401,
            "missing_signature",
            "a signature is required (X-Hub-Signature-256 or webhook-signature)"
        )
    if not _DELIVERY_RE.match(found.delivery):
        raise Refused(400, "bad_delivery", "the delivery id must be 1-128 of A-Z a-z 0-9 _ . : -")
    if found.event is not None and not _EVENT_RE.match(found.event):
        raise Refused(400, "bad_event", "the event name must be 1-64 of A-Z a-z 0-9 _ . : -")
    return found


def parse_body(headers, body, found):
    """After a valid signature: (the application/json UTF-8 object, its event name). Raises
    Refused."""
    ask.require_json(headers)
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise Refused(400, "invalid_utf8", "the body is not UTF-8") from None
    except (ValueError, RecursionError):
        raise Refused(400, "invalid_json", "the body is not JSON") from None
    if type(payload) is not dict:
        raise Refused(400, "not_an_object", "the body must be a JSON object")
    event = found.event or payload.get("type")
    if event is not None and (type(event) is not str or not _EVENT_RE.match(event)):
        raise Refused(400, "bad_event", "the body's type must be 1-64 of A-Z a-z 0-9 _ . : -")
    return payload, event or "webhook"


# -- the HTTP side ---------------------------------------------------------------


class _Server(ask.CappedServer):
    """A thread per connection, at most --max-connections at once (over the cap: a 503 at once,
    counted)."""

    def __init__(self, app):
        self.app = app
        super().__init__(
            (app.settings.host, app.settings.port), _Handler, app.settings.max_connections, _BUSY
        )

    def refused(self, client_address):
        self.app.connection_refused(client_address[0])


class _Handler(ask.RequestHandler):
    """One request per connection, then closed, read under --request-timeout (docs/daemon.md)."""

    sent = delivery = None

    def handle(self):
        self.app, started = self.server.app, time.monotonic()
        with contextlib.suppress(OSError):  # the client went away (a reset, a broken pipe)
            self._respond()
        self.deadline.cancel()
        # nothing sent (a browser's idle preconnect) is no request; a timeout is an event
        if self.line:
            status, size = self.sent or ("-", 0)
            self.app.log(
                f"{self.client_address[0]} {rl.printable(self.method)} {self.route} {status} "
                f"{size} {(time.monotonic() - started) * 1000:.1f} {self.delivery or '-'}"
            )

    @property
    def route(self):
        """The path as logged and recorded: no query, secrets masked."""
        return rl.printable(self.app.redactor.text(self.path.split("?", 1)[0][:200]))

    def check(self):
        """501 for an unknown method; DNS rebinding: only a Host (if any: else not a browser) and an
        Origin naming this daemon are answered."""
        host, origin = self.headers.get("Host"), self.headers.get("Origin")
        if self.method not in _METHODS:
            raise Refused(501, None, "unknown method")
        if host is not None and not self.app.names_us(host):
            raise Refused(
                421, "bad_host", "the Host header does not name this daemon (see --allow-host)"
            )
        if origin is not None and not self.app.names_us(ask.origin_host(origin)):
            raise Refused(403, "bad_origin", "requests from this Origin are refused")

    def allowed(self, path):
        if path == "/webhook":
            return "POST"
        return "GET" if path in ("/", "/healthz", "/runs") or path.startswith("/runs/") else None

    def _respond(self):
        try:
            # the read side only: the handler can still answer 408
            s = self.app.settings
            body = self.read_request(s.request_timeout, s.max_body, socket.SHUT_RD)
        except Refused as refused:
            self._refuse(refused)
            return self._linger()
        path = self.path.split("?", 1)[0]
        try:
            if path != "/webhook":
                return self._read(path)
            found = authenticate(self.app.settings.keys, self.headers, body)
            self.delivery = found.delivery
            payload, event = parse_body(self.headers, body, found)
            self._reply(*self.app.accept(found, event, body, payload, self.client_address[0]))
        except Refused as refused:
            self._refuse(refused)
        except Exception as exc:  # the boundary: recorded, answered 500 without details
            self.app.record_error(f"{self.method} {self.route}", exc)
            self._reply(500, {"error": "internal error"})

    def _refuse(self, refused):
        """Record a refusal on /webhook (a timeout on any path), then answer it."""
        claimed = (
            self.headers.get("X-GitHub-Delivery") or self.headers.get("webhook-id") or ""
        ).strip() or None
        if claimed is not None and not _DELIVERY_RE.match(claimed):
            claimed = "(not a delivery id)"
        if refused.status == 408:
            self.app.record_rejected(
                "webhook_timeout",
                {
                    "remote": self.client_address[0],
                    "stage": self.stage,
                    "path": self.route,
                    "delivery": claimed,
                    "timeout_s": self.app.settings.request_timeout
                }
            )
        elif refused.reason and self.path.split("?", 1)[0] == "/webhook":
            self.app.record_rejected(
                "webhook_rejected",
                {
                    "reason": refused.reason,
                    "status": refused.status,
                    "remote": self.client_address[0],
                    "delivery": self.delivery or claimed
                }
            )
        self._reply(refused.status, {"error": refused.message}, refused.headers)

    def _linger(self):
        """Drain a little of what the client still sends (LINGER_BYTES, for LINGER_S at most): a
        close with unread input resets the answer before the client reads it, and an unbounded
        drain is a free firehose."""
        end, drained = time.monotonic() + LINGER_S, 0
        with contextlib.suppress(OSError):  # a timeout too
            self.connection.shutdown(socket.SHUT_WR)
            while drained < LINGER_BYTES and time.monotonic() < end:
                self.connection.settimeout(max(0.01, end - time.monotonic()))
                chunk = self.connection.recv(16384)
                if not chunk:
                    break
                drained += len(chunk)

    def _read(self, path):
        allowed = self.app.read_allowed(self.headers.get("Authorization"))
        if path == "/healthz":
            return self._reply(200, self.app.health(detailed=allowed))
        if not allowed:
            self.app.record_rejected(
                "read_rejected", {"remote": self.client_address[0], "path": self.route}
            )
            raise Refused(
                401,
                None,
                "a read token is required (Authorization: Bearer TOKEN)",
                {"WWW-Authenticate": 'Bearer realm="daemon.py"'}
            )
        if path == "/runs":
            return self._reply(200, {"runs": self.app.runs()})
        if path == "/":
            return self._reply(200, index_html(self.app.runs()))
        match = _FILE_URL_RE.match(path)
        if match:  # a file of the run: served as text, never as a page
            run_id, name = match.groups()
            data = read_run_file(self.app.settings.runs_dir, self.app.run_events(run_id), name)
            if data is None:
                raise Refused(404, None, "no such file in that run's ledger")
            return self._reply(200, data, {"Content-Type": "text/plain; charset=utf-8"})
        match = _RUN_URL_RE.match(path)  # before the file system is touched
        found = self.app.run_events(match.group(1)) if match else None
        if found is None:
            raise Refused(404, None, "no such run")
        if "text/html" not in (self.headers.get("Accept") or "").lower():
            return self._reply(200, found)
        return self._reply(200, timeline_html(found, self.app.settings.runs_dir / found["run_id"]))

    def _reply(self, status, body, headers=None):
        """The answer, then the connection closes: a str is an HTML page (under a policy that runs
        nothing)."""
        page = type(body) is str
        data = (
            body
            if type(body) is bytes
            else (body if page else json.dumps(body, ensure_ascii=False) + "\n").encode("utf-8")
        )
        head = dict(_HEADERS, Date=email.utils.formatdate(usegmt=True), **(headers or {}))
        if page:
            head.update(
                {
                    "Content-Type": "text/html; charset=utf-8",
                    "Content-Security-Policy": _PAGE_POLICY
                }
            )
        answer = ask.http_answer(status, data, head.items(), close=True)
        self.sent = (status, len(data))
        try:
            self.connection.settimeout(self.deadline.remaining() + RESPONSE_GRACE_S)
            self.wfile.write(answer[: len(answer) - len(data)] if self.method == "HEAD" else answer)
        except OSError:
            pass  # the client went away; what was accepted is recorded already


# -- the daemon ------------------------------------------------------------------


def _wait(poll, until):
    """poll() -> (ended, exit code), asked every 0.1 s until it ends or until() has passed; its last
    answer."""
    ended, code = poll()
    while not ended and time.monotonic() < until():
        time.sleep(0.1)
        ended, code = poll()
    return ended, code


def _is_run_process(pid, run_id):
    """Is `pid` a live `agent.py run --run-id=RUN_ID`? (Its command line, read through /proc:
    Linux.)"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"--run-id={run_id}".encode() in argv and b"run" in argv


class Daemon:
    """The daemon: serve_settings(), its ledger, the deliveries seen, the queue and the one
    worker."""

    def __init__(self, settings, log, say):
        self.settings, self.log, self._say = settings, log, say
        self.redactor = rl.Redactor(rl.secret_values(settings.secrets))
        self.child_env = {k: v for k, v in os.environ.items() if k not in DAEMON_ENV + PIPED_ENV}
        self.piped = json.dumps({k: os.environ[k] for k in PIPED_ENV if k in os.environ}).encode(
            "utf-8"
        )
        # delivery id -> run id (None: a ping); GitHub body sha256 -> delivery
        self.deliveries, self.bodies = {}, {}
        self.queue, self.cond = collections.deque(), threading.Condition()
        self.running = self.last_run = self.stop_at = self.ledger = self.server = self.worker = (
            self.serving
        ) = None
        self.draining, self.started_at = False, time.monotonic()
        self.rejections = rl.Bucket()  # an unauthenticated flood: a bounded rate
        self.connections = rl.Bucket(1 / CONNECTION_EVENT_EVERY_S, 1)

    def start(self):
        """Lock the runs directory, bind, recover what an earlier daemon left, serve. Returns
        http://host:port."""
        s, path = self.settings, self.settings.runs_dir / DAEMON_LEDGER
        s.runs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # one daemon per runs directory: two would both pick up the same unfinished deliveries
        self._lock_fd = agent._hold_lock(
            s.runs_dir / "daemon.lock", f"another daemon serves {s.runs_dir}", ""
        )
        try:
            if path.exists():
                rl.verify(path)
        except rl.TornTailError:
            # a crash mid-append: the first append below moves the fragment aside and records it
            pass
        try:
            self.server = _Server(self)
        except OSError as exc:
            raise rl.UsageError(
                f"cannot listen on {s.host}:{s.port}: {exc.strerror or exc}"
            ) from None
        host, port = self.server.server_address[:2]
        address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.ledger = rl.Ledger(
            path, f"daemon-{rl.new_run_id()}", secrets=s.secrets, signer=rl.env_signer()
        )
        self.record("daemon_started", self._started(address))
        self._recover()
        self.say(f"serving on {address}")  # before the worker can say a run started
        self.worker = threading.Thread(target=self._work, name="worker", daemon=True)
        self.serving = threading.Thread(
            target=self.server.serve_forever, args=(0.2,), name="accept", daemon=True
        )
        self.worker.start()
        self.serving.start()
        return address

    def _started(self, address):
        """daemon_started: the address and the settings, never a secret."""
        s = self.settings
        shown = (
            "token_required max_body queue max_connections grace_s kill_after_s fetch allow_hosts"
        )
        return dict(
            {name: getattr(s, name) for name in shown.split()},
            address=address,
            pid=os.getpid(),
            repo=str(s.repo),
            runs_dir=str(s.runs_dir),
            tools=str(s.tools),
            tools_sha256=s.policy.sha256,
            secrets=len(s.keys),
            read_token=bool(s.read_token),
            backlog=_Server.request_queue_size,
            request_timeout_s=s.request_timeout,
            agent_version=__version__,
            python=sys.version.split()[0]
        )

    def stop(self, signum=None):
        """Stop accepting, finish the requests in flight, give a run --grace-s; what is queued stays
        recorded."""
        name = signal.Signals(signum).name if signum else None
        with self.cond:
            running, queued = self.running, len(self.queue)
            self.draining, self.stop_at = True, time.monotonic() + self.settings.grace_s
            self.cond.notify_all()
        self.say(
            f"draining{f' on {name}' if name else ''}: no new run starts; "
            + (f"run {running} gets {self.settings.grace_s:g} s to finish; " if running else "")
            + f"{queued} queued stay recorded for the next start"
        )
        self.server.stop(self.settings.request_timeout + RESPONSE_GRACE_S + 1)
        self.worker.join(self.settings.grace_s + 2 * TERMINATE_WAIT_S + 5)
        with self.cond:
            queued = [item["run_id"] for item in self.queue]
        self.record(
            "daemon_stopped",
            {
                "signal": name,
                "queued": queued,
                "unrecorded_rejections": self.rejections.refused,
                "uptime_s": round(time.monotonic() - self.started_at, 3)
            }
        )
        self.ledger.close()
        os.close(self._lock_fd)

    def record(self, kind, payload):
        return self.ledger.append(kind, payload)

    def record_error(self, where, exc):
        """An unexpected error at a boundary: an event with the traceback as an artifact, one stderr
        line."""
        self.log(f"error: {where}: {type(exc).__name__} (recorded in {DAEMON_LEDGER})")
        try:
            trace = self.ledger.store_artifact(traceback.format_exc())
            self.record(
                "daemon_error",
                {
                    "where": where,
                    "type": type(exc).__name__,
                    "message": rl.error_text(exc)[:2000],
                    "traceback_artifact": trace
                }
            )
        except (rl.LedgerError, OSError):
            pass  # the ledger itself is what failed; the stderr line is all there is

    def record_rejected(self, kind, payload):
        """A rejection event, rate-limited; the next one recorded counts those dropped."""
        payload = self.rejections.counted(payload)
        if payload is not None:
            self.record(kind, payload)

    def connection_refused(self, remote):
        """A connection over the cap: logged, and recorded at most once every few seconds with the
        count."""
        dropped = self.connections.take()
        if dropped is not None:
            self.record(
                "connection_limit",
                {
                    "refused": dropped + 1,
                    "max_connections": self.settings.max_connections,
                    "remote": remote
                }
            )
        self.log(f"{remote} - - 503 0 0.0 - (over {self.settings.max_connections} connections)")

    def say(self, line):
        self._say(self.redactor.text(line))

    def names_us(self, value):
        """Does a Host (or an Origin's host) name this daemon?"""
        name = ask.host_name(value)
        # listening on every address, any address literal: no name, no rebinding
        return (
            name in self.settings.names
            or bool(name and (":" in name or re.fullmatch(r"[0-9.]+", name)))
            and self.settings.host in ("0.0.0.0", "::", "")
        )

    def accept(self, found, event, body, payload, remote):
        """Record a delivery (fsync'd) and queue its run, or answer a redelivery or a full queue."""
        after = payload.get("after")  # a GitHub push's commit
        if not (
            event == "push" and type(after) is str and _COMMIT_RE.match(after) and after.strip("0")
        ):
            after = None
        digest = hashlib.sha256(body).hexdigest()
        with self.cond:
            # GitHub signs the body but not the delivery id or the event: a signed body seen before
            # (a ping's too) is the same delivery whatever id and event it claims now, so a captured
            # request starts no run
            original = (
                found.delivery
                if found.delivery in self.deliveries
                else (self.bodies.get(digest) if found.source == "github" else None)
            )
            if original is not None:
                return self._duplicate(found, event, remote, digest, original)
            if event != "ping" and len(self.queue) >= self.settings.queue:
                self.record(
                    "queue_full",
                    {
                        "delivery": found.delivery,
                        "event": event,
                        "queued": len(self.queue),
                        "max": self.settings.queue,
                        "remote": remote
                    }
                )
                return (
                    503,
                    {"error": "the queue is full; retry later"},
                    {"Retry-After": str(RETRY_AFTER_S)}
                )
            run_id = None if event == "ping" else rl.new_run_id()
            received = {
                "event": event,
                "delivery": found.delivery,
                "source": found.source,
                "run_id": run_id,
                "body_sha256": digest,
                "body_artifact": self.ledger.store_artifact(body),
                "body_bytes": len(body),
                "remote": remote
            }
            self.record("webhook_received", dict(received, after=after) if after else received)
            self.deliveries[found.delivery] = run_id
            if found.source == "github":
                self.bodies[digest] = found.delivery
            if run_id:
                self.queue.append(
                    {"run_id": run_id, "delivery": found.delivery, "event": event, "after": after}
                )
                self.cond.notify_all()
        return (202 if run_id else 200), {"run_id": run_id, "delivery": found.delivery}, {}

    def _duplicate(self, found, event, remote, digest, original):
        """A delivery seen before, by its id or (GitHub) its body: its first run, and no new one."""
        run_id = self.deliveries[original]
        duplicate = {
            "delivery": found.delivery,
            "event": event,
            "run_id": run_id,
            "source": found.source,
            "remote": remote,
            "body_sha256": digest
        }
        if original != found.delivery:
            duplicate["same_body_as"] = original
        self.record("webhook_duplicate", duplicate)
        return 200, {"run_id": run_id, "delivery": original, "duplicate": True}, {}

    def _work(self):
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.draining)
                if self.draining and not (self.queue and self.queue[0].get("pid")):
                    return  # nothing new starts once stopping; an adopted run is still watched
                item = self.queue.popleft()
                self.running = item["run_id"]
            try:
                self._run(item)
            except Exception as exc:  # the boundary: the worker goes on with the next delivery
                self.record_error(f"run {item['run_id']}", exc)
            with self.cond:
                self.running = None

    def _run(self, item):
        run_id, started, pid, tail = item["run_id"], time.monotonic(), item.get("pid"), ""
        if pid:
            code, how = self._watch(pid, lambda: (not _is_run_process(pid, run_id), None))
        else:
            ref = self._choose_ref(item)
            with self.cond:
                # stopping: it stays received and not dispatched, for the next start
                if self.draining:
                    self.queue.appendleft(item)
                    return
            self.record(
                "run_dispatched",
                {
                    "run_id": run_id,
                    "delivery": item["delivery"],
                    "event": item["event"],
                    "ref": ref
                }
            )
            self.say(
                f"run {run_id} started: {item['event']} delivery {item['delivery']}"
                + (f" at {ref[:12]}" if ref else "")
            )
            code, how, tail = self._child(item, ref)
        run_outcome, why = self._closed(run_id)
        outcome = how or (
            "locked"
            if code == rl.EXIT_LOCKED
            else run_outcome
            or (
                "interrupted"
                if code is None
                else "usage_error" if code == rl.EXIT_USAGE else "error"
            )
        )
        finished = {
            "run_id": run_id,
            "delivery": item["delivery"],
            "exit_code": code,
            "outcome": outcome,
            "run_outcome": run_outcome,
            "duration_ms": round((time.monotonic() - started) * 1000, 1)
        }
        if pid:
            finished["adopted_pid"] = pid
        if tail:
            finished["output_tail"] = tail
        with self.cond:  # healthz never shows a last_run older than the ledger's run_finished
            self.last_run = finished
            self.record("run_finished", finished)
        if not run_outcome:  # it did not close itself: why is how the daemon ended it
            why = {
                "killed": f"killed after {self.settings.kill_after_s:g} s",
                "terminated": "the daemon stopped",
                "locked": "another run holds the repository's lock"
            }.get(outcome) or (tail.strip().splitlines() or [""])[-1]
        self.say(f"run {run_id} {outcome}: {why or '-'}")

    def _child(self, item, ref):
        """`agent.py run`, its keys on its stdin: (exit code, how the daemon ended it, its output's
        tail if failed)."""
        s = self.settings
        argv = [
            sys.executable,
            str(agent.HERE / "agent.py"),
            "run",
            "--repo",
            str(s.repo),
            "--runs-dir",
            str(s.runs_dir),
            "--tools",
            str(s.tools),
            f"--run-id={item['run_id']}",
            f"--delivery={item['delivery']}",
            f"--event={item['event']}",
            "--settings-on-stdin"
        ]
        argv += ([f"--ship-to={s.ship_to}"] if s.ship_to else []) + (
            [f"--ref={ref}"] if ref else []
        )
        with tempfile.TemporaryFile() as output:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=self.child_env,
                    cwd=str(agent.HERE),
                    start_new_session=True,
                    close_fds=True
                )
            # EMFILE, ENOMEM, a vanished install: finished as an error, not redone
            except OSError as exc:
                return None, "error", f"cannot start agent.py run: {rl.error_text(exc)}"
            agent._feed_stdin(proc.stdin, self.piped)
            code, how = self._watch(proc.pid, lambda: (proc.poll() is not None, proc.returncode))
            if code in agent.OUTCOME_EXIT.values():
                return code, how, ""
            output.seek(max(0, output.seek(0, os.SEEK_END) - 2000))
            return code, how, output.read().decode("utf-8", "replace")

    def _watch(self, pid, poll):
        """(exit code, how it ended: None, "killed" past --kill-after-s, "terminated" past a stop's
        grace)."""
        kill_at = time.monotonic() + self.settings.kill_after_s
        ended, code = _wait(poll, lambda: min(kill_at, self.stop_at or kill_at))
        how = None if ended else "killed" if time.monotonic() >= kill_at else "terminated"
        # on SIGTERM the agent closes its run
        for signum in (signal.SIGTERM, signal.SIGKILL) if how else ():
            try:
                os.killpg(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
            end = time.monotonic() + TERMINATE_WAIT_S
            ended, code = _wait(poll, lambda: end)
            if ended:
                break
        return code, how

    def _choose_ref(self, item):
        """A push's `after` commit when the repository has it (after `git fetch` with --fetch), else
        None."""
        repo, started, after = str(self.settings.repo), time.monotonic(), item.get("after")
        if self.settings.fetch:
            try:
                proc = subprocess.run(
                    ["git", "-C", repo, "fetch", "--quiet", "--no-recurse-submodules"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=agent._git_env(),
                    timeout=300
                )
                code, output = proc.returncode, proc.stdout.decode("utf-8", "replace")[-1000:]
            except subprocess.TimeoutExpired:
                code, output = None, "git fetch timed out after 300 s"
            self.record(
                "git_fetch",
                {
                    "run_id": item["run_id"],
                    "delivery": item["delivery"],
                    "returncode": code,
                    "duration_ms": round((time.monotonic() - started) * 1000, 1),
                    "output": output
                }
            )
        has = (
            after
            and agent.git(repo, "cat-file", "-t", after, check=False, timeout=60).strip()
            == b"commit"
        )
        return after if has else None

    def _closed(self, run_id):
        """(the outcome the run recorded when it closed, or None; why it ended, as its events
        say)."""
        run = rl.run_summary(agent._events_of(self.settings.runs_dir / run_id))
        return (None if run["outcome"] == "open" else run["outcome"]), run["why"] or ""

    def _replay(self):
        """daemon.jsonl read again into the delivery map and the last run: (run id: webhook_received
        payload, the run ids dispatched, those finished)."""
        received, dispatched, finished = {}, set(), set()
        for event in rl.read_events(self.ledger.path, run_id=None):
            kind, payload = event["kind"], event["payload"]
            if kind == "webhook_received" and type(payload.get("delivery")) is str:
                self.deliveries[payload["delivery"]] = payload.get("run_id")
                if payload.get("source") == "github" and payload.get("body_sha256"):
                    self.bodies[payload["body_sha256"]] = payload["delivery"]
                if type(payload.get("run_id")) is str:
                    received[payload["run_id"]] = payload
            elif kind == "run_dispatched":
                dispatched.add(payload.get("run_id"))
            elif kind == "run_finished":
                finished.add(payload.get("run_id"))
                self.last_run = payload
        return received, dispatched, finished

    def _recover(self):
        """Rebuild the delivery map from daemon.jsonl; requeue, adopt or close what an earlier
        daemon left."""
        received, dispatched, finished = self._replay()
        summary, adopted, requeued = (
            {"requeued": [], "adopted": [], "finished": [], "interrupted": []},
            [],
            []
        )
        pids = (
            [name for name in os.listdir("/proc") if name.isdigit()]
            if os.path.isdir("/proc")
            else []
        )
        for run_id, payload in received.items():
            if run_id in finished:
                continue
            item = {k: payload.get(k) for k in ("run_id", "delivery", "after")}
            item["event"] = payload.get("event") or "webhook"
            pid = (
                next((int(p) for p in pids if _is_run_process(p, run_id)), None)
                if run_id in dispatched
                else None
            )
            if pid is not None:
                adopted.append(dict(item, pid=pid))
            elif run_id not in dispatched or not (self.settings.runs_dir / run_id).exists():
                requeued.append(item)
            else:
                outcome = self._closed(run_id)[0]
                summary["finished" if outcome else "interrupted"].append(run_id)
                self.record(
                    "run_finished",
                    {
                        "run_id": run_id,
                        "delivery": payload["delivery"],
                        "exit_code": None,
                        "outcome": outcome or "interrupted",
                        "run_outcome": outcome,
                        "recovered": True
                    }
                )
        summary.update(
            adopted=[i["run_id"] for i in adopted], requeued=[i["run_id"] for i in requeued]
        )
        self.queue.extend(adopted + requeued)
        if any(summary.values()):
            self.record("daemon_recovered", summary)

    def read_allowed(self, authorization):
        """The bearer token of the read endpoints (not needed on loopback without a token)."""
        token = self.settings.read_token
        return (
            not self.settings.token_required or bool(token) and ask.bearer_ok(authorization, token)
        )

    def health(self, detailed):
        if not detailed:
            return {"ok": True}
        with self.cond:
            return {
                "ok": True,
                "queued": len(self.queue),
                "running": self.running,
                "last_run": self.last_run,
                "deliveries": len(self.deliveries),
                "draining": self.draining,
                "uptime_s": round(time.monotonic() - self.started_at, 3),
                "version": __version__
            }

    def runs(self):
        """GET /runs: list_runs' rows (with the head the index recorded) and the delivery that
        asked."""
        with self.cond:
            origin = {run_id: delivery for delivery, run_id in self.deliveries.items() if run_id}
        rows = agent.list_runs(self.settings.runs_dir)
        for row in rows:
            row["delivery"] = origin.get(row["run_id"])
        return rows

    def run_events(self, run_id):
        """GET /runs/<id> (an id of new_run_id()'s shape): its events as far as they verify;
        None: no such run."""
        path = self.settings.runs_dir / run_id / rl.EVENTS_NAME
        if not path.is_file():
            return None
        events, problem = [], None
        try:
            for event in itertools.islice(rl.read_events(path), MAX_EVENTS_SHOWN + 1):
                events.append(event)
        except rl.IntegrityError as exc:
            problem = f"line {exc.line}: {exc.reason}" if exc.line else exc.reason
        except (rl.LedgerError, OSError) as exc:
            problem = type(exc).__name__
        return {
            "run_id": run_id,
            "verified": problem is None,
            "problem": problem,
            "truncated": len(events) > MAX_EVENTS_SHOWN,
            "events": events[:MAX_EVENTS_SHOWN]
        }


# -- the pages: the index of runs and one run's timeline ---------------------------------

_HIGHLIGHT = {
    "decision": "decision",
    "tool_allowed": "allowed",
    "tool_denied": "denied",
    "judge_verdict": "verdict",
    "error": "denied",
    "proposal_malformed": "denied",
    "patch_rejected": "denied",
    "run_closed": "verdict"
}
_PAGE_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
_PAGE_STYLE = (
    "body{font:14px/1.45 system-ui,sans-serif;margin:1.5em}"
    "table{border-collapse:collapse;width:100%}"
    "td,th{border-bottom:1px solid #ddd;padding:.3em .5em;vertical-align:top;text-align:left}"
    "pre{white-space:pre-wrap;word-break:break-word;margin:0}"
    "dt{font-weight:600}dd{margin:0 0 .3em 1em}"
    ".decision{background:#eef6ff}.allowed{background:#effaef}.denied{background:#fff0f0}"
    ".verdict{background:#fff8e6}.bad{color:#a00}.diff{border:1px solid #ddd;padding:.5em}"
    ".diff span{display:block;min-height:1.45em}.add{background:#e6ffec;color:#116329}"
    ".del{background:#ffebe9;color:#82071e}.hunk{color:#0550ae}.file{font-weight:600}"
)


def _shown(value):
    text = value if type(value) is str else json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_SHOWN_CHARS:
        text = text[:MAX_SHOWN_CHARS] + f"\n[... {len(text) - MAX_SHOWN_CHARS:,} more characters]"
    return html.escape(text, quote=True)


def run_files(events):
    """{name: where the ledger names it}: the files of a run that its events list."""
    found = {}

    def walk(value, where):
        for key, item in value.items() if type(value) is dict else enumerate(value):
            if key in ("path", "proposal") and type(item) is str and _FILE_RE.fullmatch(item):
                found.setdefault(item, where)
            elif type(item) in (dict, list):
                walk(item, f"{where} {key}" if type(key) is str else where)

    for event in events:
        walk(event["payload"], f"#{event['seq']} {event['kind']}")
    return found


def read_run_file(runs_dir, found, name):
    """A file the run's ledger lists, read without following a link anywhere below RUNS (a link,
    a FIFO or a directory is not served); at most MAX_FILE_BYTES of it. None: not one."""
    path = os.path.join(os.path.realpath(runs_dir), found["run_id"] if found else "", name)
    if not found or name not in run_files(found["events"]) or os.path.realpath(path) != path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read(MAX_FILE_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else None


_DIFF_CLASSES = (("+++", "file"), ("---", "file"), ("+", "add"), ("-", "del"), ("@@", "hunk"))


def _diff_html(text):
    """A patch as a diff with line colours: added, removed, hunk and file lines."""
    lines = (
        f'<span class="{next((c for p, c in _DIFF_CLASSES if line.startswith(p)), "")}">'
        f"{html.escape(line)}</span>"
        for line in text.splitlines()
    )
    return '<pre class="diff">' + "".join(lines) + "</pre>"


def timeline_html(found, run_dir):
    """A readable page of one run: a summary, then every event's fields, every value
    HTML-escaped."""
    rows = []
    for event in found["events"]:
        detail = "".join(
            f"<dt>{_shown(name)}</dt><dd><pre>{_shown(value)}</pre></dd>"
            for name, value in event["payload"].items()
            if value not in (None, "", [], {})
        )
        rows.append(
            f"<tr class=\"{_HIGHLIGHT.get(event['kind'], '')}\">"
            f"<td>{_shown(event['seq'])}</td><td>{_shown(event['at'])}</td>"
            f"<td>{_shown(event['kind'])}</td><td><dl>{detail}</dl></td></tr>"
        )
    status = (
        "verified"
        if found["verified"]
        else f"<span class=\"bad\">does not verify: {_shown(found['problem'])}</span>"
    )
    more = f" (the first {len(found['events'])} events)" if found["truncated"] else ""
    run = rl.run_summary(found["events"])
    summary = "".join(
        f"<dt>{name}</dt><dd>{_shown(value or '-')}</dd>"
        for name, value in (
            ("outcome", "open (not closed yet)" if run["outcome"] == "open" else run["outcome"]),
            ("why", run["why"]),
            ("proposal", run["proposal"]),
            ("verdict", run["judge_verdict"])
        )
    )
    links = "".join(
        f"<li><a href=\"/runs/{_shown(found['run_id'])}/{name}\">{name}</a> ({_shown(where)})</li>"
        for name, where in run_files(found["events"]).items()
    )
    patch = read_run_file(run_dir.parent, found, "proposal.patch")
    shown = _diff_html(patch.decode("utf-8", "replace")) if patch is not None else ""
    return _page(
        f"run {found['run_id']}",
        f"<dl class=\"summary\">{summary}</dl>{shown}<ul>{links}</ul><p>{len(found['events'])}"
        f" events{more}, {status}</p>" + _table(("seq", "at", "kind", "what"), rows)
    )


def index_html(rows):
    """GET /: every run, newest first, with its outcome and why, linked to its timeline."""
    names = ("started", "outcome", "why", "steps", "tokens", "verified")
    body = []
    for row in sorted(rows, key=lambda r: r["run_id"], reverse=True):
        shown = dict(row, tokens=agent._tokens_cell(row))
        cells = "".join(
            f"<td>{_shown('-' if shown[name] in (None, '') else shown[name])}</td>"
            for name in names
        )
        body.append(
            f"<tr><td><a href=\"/runs/{_shown(row['run_id'])}\">{_shown(row['run_id'])}</a></td>"
            f"{cells}</tr>"
        )
    return _page(
        "runs",
        f"<p>{rl.plural(len(rows), 'run')}, newest first</p>" + _table(("run_id",) + names, body)
    )


def _table(names, rows):
    head = "".join(f"<th>{name}</th>" for name in names)
    return f"<table><thead><tr>{head}</tr></thead><tbody>" + "".join(rows) + "</tbody></table>"


def _page(title, body):
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_shown(title)}</title><style>{_PAGE_STYLE}</style></head><body>"
        f"<h1>{_shown(title)}</h1>{body}</body></html>\n"
    )


_LOG_LOCK = threading.Lock()


def _stderr_line(line, stream=None):
    """One access-log (or error) line on stderr, or a line on `stream`; a closed one never stops the
    daemon."""
    try:
        with _LOG_LOCK:
            stream = stream or sys.stderr
            stream.write(rl.printable(line) + "\n")
            stream.flush()
    except (OSError, ValueError):
        pass


def _serve(args):
    daemon = Daemon(
        serve_settings(args, os.environ), _stderr_line, lambda line: _stderr_line(line, sys.stdout)
    )
    received = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: received.append(number))
    daemon.start()
    if not daemon.settings.keys:
        rl.warn(
            "no webhook secret (WEBHOOK_SECRET, WEBHOOK_SECRET_FILE): unsigned deliveries are "
            "accepted; this is allowed on a loopback address only"
        )
    if daemon.settings.token_required and not daemon.settings.read_token:
        rl.warn("no read token (READ_TOKEN): /, /runs and /runs/<id> answer 401 to everyone")
    while not received and daemon.serving.is_alive() and daemon.worker.is_alive():
        time.sleep(0.1)
    daemon.stop(received[0] if received else None)
    if not received:
        rl.error("the daemon's accept loop or worker stopped unexpectedly; see daemon_error events")
        return rl.EXIT_FAILED
    return rl.EXIT_OK


_LIMITS = (  # flag, type, default, metavar, help
    ("--max-body", int, 5 * 1024 * 1024, "BYTES", "larger bodies get 413 unread"),
    ("--queue", int, 16, "N", "deliveries waiting for the worker; more get 503"),
    ("--max-connections", int, 64, "N", "connections handled at once; more get 503"),
    ("--request-timeout", float, 10, "S", "wall deadline of a whole request, headers and body"),
    (
        "--grace-s",
        float,
        30,
        "S",
        "on SIGTERM/SIGINT, a run in progress gets this long, then is terminated"
    )
)


def _build_parser():
    p = rl.ArgumentParser(
        prog="daemon.py",
        description="The webhook daemon: signed deliveries start agent runs, one at a time.",
        epilog=rl.exit_codes_epilog(rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument(
        "--repo",
        required=True,
        help="the git repository runs work on (never modified; --fetch fetches)"
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="(default %(default)s; any other needs a webhook secret)"
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="(default %(default)s; 0: any free port)"
    )
    p.add_argument(
        "--runs-dir", default=agent.DEFAULT_RUNS, help="where runs and daemon.jsonl are recorded"
    )
    p.add_argument("--tools", default=str(agent.DEFAULT_TOOLS), help="the allowlist every run uses")
    for flag, kind, default, metavar, text in _LIMITS:
        p.add_argument(
            flag, type=kind, default=default, metavar=metavar, help=f"{text} (default %(default)s)"
        )
    p.add_argument(
        "--kill-after-s",
        type=float,
        metavar="S",
        help="kill a run after this long (default: tools.json's "
        f"max_wall_s + 2 x test_timeout_s + {KILL_MARGIN_S})"
    )
    p.add_argument(
        "--fetch", action="store_true", help="git fetch in the repository before each run"
    )
    p.add_argument(
        "--ship-to",
        metavar="URL",
        help="each run ships its ledger and the index to ClickHouse at URL"
    )
    p.add_argument(
        "--read-token", help="bearer token for /runs (prefer READ_TOKEN: arguments show in ps)"
    )
    p.add_argument(
        "--allow-host", action="append", metavar="NAME", help="a Host to answer too (repeatable)"
    )
    return p


def main(argv=None):
    return rl.run_main(_build_parser(), argv, _serve)


if __name__ == "__main__":
    sys.exit(main())
