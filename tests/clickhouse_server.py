"""clickhouse_server.py -- a real, throwaway ClickHouse server for tests and the bench (stdlib only).

Starts `clickhouse-server` in the foreground as the current user (root included) on free loopback
ports, with its config, users, data and logs all inside a directory you give it. Verified with
Debian's clickhouse-server 18.16.1 (start to /ping: 0.05-0.2 s; SIGTERM stop: 0.5-1.7 s).

    from clickhouse_server import ClickHouse, find_binary, skip_reason

    skip_reason()                  # None if a server can be started here, else a one-line reason
    ch = ClickHouse.start(tmp_dir) # free ports, config in tmp_dir, waits for GET /ping == "Ok."
    ch.url                         # "http://127.0.0.1:PORT"   (ch.http_port, ch.tcp_port too)
    ch.query("SELECT 1")           # -> "1\n"; raises ClickHouseError(status, body) on HTTP errors
    ch.query("INSERT INTO t FORMAT JSONEachRow", data=b'{"a":1}\\n')
    ch.query("SELECT 1", user="shipper", password=ch.SHIPPER_PASSWORD)  # X-ClickHouse-User/-Key
    ch.kill()                      # SIGKILL the process group ("server down")
    ch.restart()                   # same ports, same data dir ("server is back")
    ch.stop()                      # SIGTERM the group, SIGKILL after a few seconds

Also: ch.query_bytes(...) (same, returns bytes -- use with FORMAT RowBinary/TSVRaw for exact bytes),
query(..., params={"input_format_skip_unknown_fields": 1}, headers={"Content-Encoding": "gzip"},
timeout=120), `data` may be an open binary file (streamed, chunked), ch.client_argv("--query", sql)
for clickhouse-client on ch.tcp_port, ch.alive(), ch.ping(), ch.log_tail(), ch.start_seconds.
ClickHouseError has .status (e.g. 401 wrong password, 400 syntax, 404 unknown table) and .body.

18.16 gotchas for tests: a query that fails mid-stream still returns HTTP 200 with the error text
at the end of the body (pass params={"wait_end_of_query": 1} to get a 500); TRUNCATE TABLE / DROP
PARTITION are undone by a restart if merges happened in the last 8 minutes (old parts come back),
so use DROP TABLE / DROP DATABASE before a kill()/restart().

Users (users.xml written next to config.xml):
    default  -- no password
    shipper  -- password ClickHouse.SHIPPER_PASSWORD ("shipper-pass"); both only from 127.0.0.1/::1

Binary lookup: $CLICKHOUSE_SERVER (a path), then `clickhouse-server` on PATH, /usr/sbin, /usr/bin,
then a combined `clickhouse` binary (run as `clickhouse server ...`).

CLICKHOUSE_REQUIRED=1: skip_reason() still just returns the reason string; it is the caller that
turns it into a failure instead of a skip (see the fixture below). This module never skips or fails
on its own.

Suggested pytest fixtures (conftest.py):

    import os, pytest
    from clickhouse_server import ClickHouse, skip_reason

    @pytest.fixture(scope="session")
    def clickhouse(tmp_path_factory):
        reason = skip_reason()
        if reason:
            if os.environ.get("CLICKHOUSE_REQUIRED") == "1":
                pytest.fail("CLICKHOUSE_REQUIRED=1 but " + reason, pytrace=False)
            pytest.skip(reason)
        ch = ClickHouse.start(tmp_path_factory.mktemp("clickhouse"))
        yield ch
        ch.stop()

    @pytest.fixture
    def ch_db(clickhouse, request):
        # one fresh database per test, so a session-scoped server stays cheap and tests stay apart
        name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:60]
        clickhouse.query("DROP DATABASE IF EXISTS " + name)
        clickhouse.query("CREATE DATABASE " + name)
        yield name
        if clickhouse.alive():
            clickhouse.query("DROP DATABASE IF EXISTS " + name)

A test that kill()s the server should either use its own function-scoped ClickHouse.start(tmp_path)
or restart() the shared one before it returns (restart() is idempotent: it stops first if needed).
"""

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from xml.sax.saxutils import escape as _xml_escape

__all__ = ["ClickHouse", "ClickHouseError", "find_binary", "skip_reason"]

HOST = "127.0.0.1"
START_TIMEOUT = 30.0
STOP_GRACE = 5.0

_LIVE = set()  # servers started by this process, stopped at interpreter exit if still running


class ClickHouseError(RuntimeError):
    """An HTTP error from the server; .status is the HTTP status, .body the server's text."""

    def __init__(self, status, body, sql=""):
        self.status = status
        self.body = body
        self.sql = sql
        super().__init__(f"ClickHouse HTTP {status}: {body.strip()}" + (f"\n  SQL: {sql[:300]}" if sql else ""))


def find_binary():
    """argv prefix list to run the server (e.g. ['/usr/sbin/clickhouse-server']), or None."""
    override = os.environ.get("CLICKHOUSE_SERVER")
    if override:
        path = shutil.which(override) or (override if os.access(override, os.X_OK) else None)
        if not path:
            return None
        return [path, "server"] if os.path.basename(path) == "clickhouse" else [path]
    for candidate in (shutil.which("clickhouse-server"), "/usr/sbin/clickhouse-server",
                      "/usr/bin/clickhouse-server", "/usr/local/bin/clickhouse-server"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return [candidate]
    for candidate in (shutil.which("clickhouse"), "/usr/bin/clickhouse", "/usr/local/bin/clickhouse"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return [candidate, "server"]
    return None


@functools.lru_cache(maxsize=None)
def skip_reason():
    """None if a server can really be started here, else a one-line reason.

    Checked once per process: start one in a throwaway dir, SELECT 1, SIGKILL it (~0.2 s).
    With CLICKHOUSE_REQUIRED=1 the caller should fail on a non-None reason rather than skip;
    this function behaves the same either way."""
    argv = find_binary()
    if argv is None:
        where = os.environ.get("CLICKHOUSE_SERVER")
        return (f"CLICKHOUSE_SERVER={where} is not an executable" if where
                else "clickhouse-server not installed (not on PATH, /usr/sbin, /usr/bin)")
    probe_dir = tempfile.mkdtemp(prefix="ch-probe-")
    try:
        ch = ClickHouse.start(probe_dir, timeout=20)
        try:
            if ch.query("SELECT 1").strip() != "1":
                return "clickhouse-server started but SELECT 1 did not return 1"
        finally:
            ch.kill()  # the probe dir is thrown away, so no clean shutdown is needed
    except Exception as exc:  # noqa: BLE001 -- any failure means "not usable here"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"clickhouse-server ({argv[0]}) not usable: {first}"
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    return None


def _free_ports(count):
    """Ports the kernel hands out for bind(0), all held at once so they differ, then released."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path, lines=30):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


CONFIG_XML = """<?xml version="1.0"?>
<yandex>
    <logger>
        <level>{log_level}</level>
        <log>{dir}/log/server.log</log>
        <errorlog>{dir}/log/server.err.log</errorlog>
        <size>50M</size>
        <count>2</count>
        <console>0</console>
    </logger>
    <listen_host>{host}</listen_host>
    <http_port>{http_port}</http_port>
    <tcp_port>{tcp_port}</tcp_port>
    <path>{dir}/data/</path>
    <tmp_path>{dir}/tmp/</tmp_path>
    <user_files_path>{dir}/user_files/</user_files_path>
    <format_schema_path>{dir}/format_schemas/</format_schema_path>
    <users_config>{dir}/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <timezone>{timezone}</timezone>
    <umask>022</umask>
    <mark_cache_size>67108864</mark_cache_size>
    <uncompressed_cache_size>67108864</uncompressed_cache_size>
    <max_connections>256</max_connections>
    <keep_alive_timeout>3</keep_alive_timeout>
    <max_concurrent_queries>64</max_concurrent_queries>
    <mlock_executable>false</mlock_executable>
    <builtin_dictionaries_reload_interval>3600</builtin_dictionaries_reload_interval>
    <max_table_size_to_drop>0</max_table_size_to_drop>
    <max_partition_size_to_drop>0</max_partition_size_to_drop>
</yandex>
"""

USERS_XML = """<?xml version="1.0"?>
<yandex>
    <profiles>
        <default>
            <max_memory_usage>4000000000</max_memory_usage>
            <background_pool_size>4</background_pool_size>
        </default>
    </profiles>
    <users>
        <default>
            <password></password>
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
        <shipper>
            <password>{shipper_password}</password>
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </shipper>
    </users>
    <quotas>
        <default>
            <interval>
                <duration>3600</duration>
                <queries>0</queries>
                <errors>0</errors>
                <result_rows>0</result_rows>
                <read_rows>0</read_rows>
                <execution_time>0</execution_time>
            </interval>
        </default>
    </quotas>
</yandex>
"""


class ClickHouse:
    """One server process. Create with ClickHouse.start(dir); usable as a context manager."""

    SHIPPER_USER = "shipper"
    SHIPPER_PASSWORD = "shipper-pass"

    def __init__(self, directory, http_port, tcp_port, timezone="UTC", log_level="information"):
        self.dir = Path(directory).resolve()
        self.http_port = http_port
        self.tcp_port = tcp_port
        self.timezone = timezone
        self.log_level = log_level
        self.proc = None
        self.start_seconds = None  # wall time of the last successful (re)start, spawn -> "Ok."

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def start(cls, directory, timeout=START_TIMEOUT, timezone="UTC", log_level="information"):
        """Write config into `directory` (created if missing), start, wait for /ping.

        Free ports come from bind(0)-then-release; if the server loses a race for one of them
        ("Address already in use") it is retried with new ports, up to 3 times."""
        last = None
        for _ in range(3):
            http_port, tcp_port = _free_ports(2)
            ch = cls(directory, http_port, tcp_port, timezone=timezone, log_level=log_level)
            ch._write_config()
            try:
                ch._spawn_and_wait(timeout)
                return ch
            except RuntimeError as exc:
                last = exc
                if "already in use" not in str(exc).lower():
                    raise
        raise last

    def restart(self, timeout=START_TIMEOUT):
        """Start again on the same ports and data dir (stops first if it is still running)."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        self._spawn_and_wait(timeout)
        return self

    def stop(self, grace=STOP_GRACE):
        """SIGTERM the process group, wait up to `grace` s, then SIGKILL. Returns the exit code."""
        return self._signal_and_wait(signal.SIGTERM, grace)

    def kill(self):
        """SIGKILL the process group at once (no flush, no clean shutdown)."""
        return self._signal_and_wait(signal.SIGKILL, 0)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- queries ---------------------------------------------------------------------------
    @property
    def url(self):
        return f"http://{HOST}:{self.http_port}"

    def query_bytes(self, sql, data=None, user=None, password=None, params=None, headers=None,
                    timeout=120):
        """Run one statement over HTTP; returns the response body as bytes.

        Without `data` the SQL is the POST body (so DDL and INSERT ... VALUES work). With `data`
        (bytes, str, or a file object) the SQL goes in ?query= and `data` is the body.
        `params` adds URL parameters (settings such as input_format_skip_unknown_fields=1);
        `headers` adds request headers (e.g. {"Content-Encoding": "gzip"})."""
        url_params = dict(params or {})
        if data is None:
            body = sql.encode("utf-8")
        else:
            url_params["query"] = sql
            body = data.encode("utf-8") if isinstance(data, str) else data
        url = self.url + "/"
        if url_params:
            url += "?" + urllib.parse.urlencode(url_params)
        req = urllib.request.Request(url, data=body, method="POST")
        if user is not None:
            req.add_header("X-ClickHouse-User", user)
        if password is not None:
            req.add_header("X-ClickHouse-Key", password)
        for key, value in (headers or {}).items():
            req.add_header(key, value)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        try:
            with opener.open(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            text = err.read().decode("utf-8", "replace")
            raise ClickHouseError(err.code, text, sql) from None

    def query(self, sql, data=None, user=None, password=None, **kw):
        """As query_bytes, decoded as UTF-8 (str). Raises ClickHouseError with the body text."""
        return self.query_bytes(sql, data=data, user=user, password=password, **kw).decode("utf-8")

    def ping(self, timeout=2):
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    self.url + "/ping", timeout=timeout) as resp:
                return resp.read().decode("utf-8", "replace").strip() == "Ok."
        except (OSError, urllib.error.URLError):
            return False

    def client_argv(self, *extra):
        """argv for clickhouse-client against this server over the native TCP port."""
        client = shutil.which("clickhouse-client") or "clickhouse-client"
        return [client, "--host", HOST, "--port", str(self.tcp_port), *extra]

    @property
    def log_path(self):
        return self.dir / "log" / "server.log"

    @property
    def err_log_path(self):
        return self.dir / "log" / "server.err.log"

    def log_tail(self, lines=30):
        parts = []
        for name, path in (("stderr", self.dir / "log" / "stdout-stderr.log"),
                           ("err.log", self.err_log_path), ("server.log", self.log_path)):
            tail = _tail(path, lines)
            if tail.strip():
                parts.append(f"--- {name} ({path}) ---\n{tail}")
        return "\n".join(parts) or "(no server output)"

    # -- internals -------------------------------------------------------------------------
    def _write_config(self):
        for sub in ("data", "tmp", "user_files", "format_schemas", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        esc = _xml_escape(str(self.dir))
        (self.dir / "config.xml").write_text(CONFIG_XML.format(
            dir=esc, host=HOST, http_port=self.http_port, tcp_port=self.tcp_port,
            timezone=_xml_escape(self.timezone), log_level=self.log_level), encoding="utf-8")
        (self.dir / "users.xml").write_text(USERS_XML.format(
            shipper_password=_xml_escape(self.SHIPPER_PASSWORD)), encoding="utf-8")

    def _spawn_and_wait(self, timeout):
        argv = find_binary()
        if argv is None:
            raise RuntimeError("clickhouse-server not found (set CLICKHOUSE_SERVER=/path/to/it)")
        argv = argv + ["--config-file=" + str(self.dir / "config.xml")]
        began = time.monotonic()
        with open(self.dir / "log" / "stdout-stderr.log", "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=str(self.dir), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # own session => own process group
        _LIVE.add(self)
        deadline = began + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                _LIVE.discard(self)
                raise RuntimeError(f"clickhouse-server exited with code {code} during start-up "
                                   f"(ports http {self.http_port}, tcp {self.tcp_port})\n"
                                   + self.log_tail())
            if self.ping(timeout=1):
                self.start_seconds = time.monotonic() - began
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"clickhouse-server did not answer GET {self.url}/ping with "
                                   f"'Ok.' within {timeout:.0f} s\n" + self.log_tail())
            time.sleep(0.05)

    def _signal_and_wait(self, sig, grace):
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)  # pgid == pid because of start_new_session
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace if grace else 10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        _LIVE.discard(self)
        return proc.returncode

    def __repr__(self):
        state = "running" if self.alive() else "stopped"
        return f"<ClickHouse {self.url} tcp={self.tcp_port} dir={self.dir} {state}>"


@atexit.register
def _stop_leftovers():
    for ch in list(_LIVE):
        try:
            ch.stop(grace=2)
        except Exception:  # noqa: BLE001
            pass
