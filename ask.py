#!/usr/bin/env python3
"""ask.py -- one call to an OpenAI-compatible endpoint, one ledger line per attempt. Stdlib only.

Usage:
  python ask.py < prompt.txt                      # the answer on stdout, a model_call line in the ledger
  python ask.py prompt.txt --expect '\\b4\\b'       # assertion gate: exit 3 when the answer does not match
  python ask.py --expect-json --retries 3 < prompt.txt
  python ask.py --stream < prompt.txt             # print as it arrives; records time-to-first-token
  python ask.py --models                          # is my key and base URL right? lists the model ids

Settings (environment; flags override): BASE_URL (or OPENAI_BASE_URL), API_KEY (or OPENAI_API_KEY),
MODEL_ID (--model). Optional: LEDGER (--ledger, default ./calls.jsonl), LEDGER_RUN_ID, LEDGER_KEY.
Exit codes: 0 ok, 1 the call failed, 2 usage/config/ledger error, 3 answer received but a check failed,
5 stdout could not be written (the call is recorded).

Library (the one code path for a model call; agent.py uses it):
  import ask
  record = ask.chat([{"role": "user", "content": "2+2?"}], ledger=ledger_or_run_or_path,
                    base_url=..., model=..., api_key=..., max_tokens=200)
  record["text"], record["error_type"]
"""

import argparse
import hashlib
import http.client
import json
import math
import os
import random
import re
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # reasoning_ledger.py beside us, even under -I
import reasoning_ledger as rl  # noqa: E402

__version__ = "1.1.0"

__all__ = ["chat", "ask", "list_models", "settings_from_env", "split_base_url", "parse_usage", "run_checks", "retryable",
           "estimate_tokens", "retry_after_seconds", "ConfigError", "RecordError", "MODEL_CALL_FIELDS",
           "MODEL_CALL_OPTIONAL", "MODEL_CALL_SUMMARY", "DEFAULT_TIMEOUT", "DEFAULT_MAX_RESPONSE_BYTES",
           "DEFAULT_LEDGER"]

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

DEFAULT_LEDGER = "calls.jsonl"
DEFAULT_TIMEOUT = 120.0
DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_SSE_LINE_BYTES = 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
MAX_FIELD_CHARS = 512   # a server-chosen string (model, id, fingerprint) longer than this is cut, with a note
MAX_ERROR_CHARS = 500
MAX_PROBLEMS = 20
EST_METHOD = "chars/4"
RETRYABLE_STATUS = {408, 409, 429}
RETRYABLE_ERRORS = {"timeout", "connection_refused", "connection_error", "rate_limited", "server_error",
                    "truncated_response", "truncated_stream"}
USER_AGENT = f"reasoning-ledger-ask/{__version__}"

_S, _I, _F, _B, _N, _D, _L = str, int, float, bool, type(None), dict, list
# The model_call record, field by field, with the JSON types each may hold. This is the one definition:
# the writer builds every record from it, audit.py checks what it reads against it, and README.md's
# table lists the same names (a test holds them together).
MODEL_CALL_FIELDS = {
    "request_model": (_S,), "response_model": (_S, _N), "response_id": (_S, _N),
    "system_fingerprint": (_S, _N), "base_url": (_S,), "server_address": (_S,), "server_port": (_I,),
    "stream": (_B,), "attempt": (_I,),
    "prompt_sha256": (_S,), "prompt_chars": (_I,), "system_chars": (_I,), "message_count": (_I,),
    "messages_sha256": (_S,), "response_chars": (_I, _N),
    "usage_reported": (_B,), "usage_status": (_S,), "input_tokens": (_I, _N), "output_tokens": (_I, _N),
    "total_tokens": (_I, _N), "cached_input_tokens": (_I, _N), "reasoning_output_tokens": (_I, _N),
    "est_input_tokens": (_I,), "est_output_tokens": (_I, _N), "est_method": (_S,),
    "latency_ms": (_F, _I, _N), "ttft_ms": (_F, _I, _N), "http_status": (_I, _N), "finish_reason": (_S, _N),
    "request_id": (_S, _N), "ratelimit": (_D,), "error_type": (_S, _N), "error_code": (_S, _N),
    "error_message": (_S, _N), "check": (_B, _N), "check_detail": (_S, _N),
    "temperature": (_F, _I, _N), "max_tokens": (_I, _N),
}
# Fields present only when they apply.
MODEL_CALL_OPTIONAL = {
    "system_sha256": (_S,), "prompt_artifact": (_D,), "system_artifact": (_D,), "messages_artifact": (_D,),
    "response_artifact": (_D,), "retry_in_s": (_F, _I), "retry_reason": (_S,), "stream_options_dropped": (_B,),
    "redirect_host": (_S,), "malformed": (_L,),
}
# What `reasoning_ledger.py report` shows on a model_call's line.
MODEL_CALL_SUMMARY = ("request_model", "response_model", "error_type")


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------

class ConfigError(rl.UsageError):
    """A setting or argument is missing or wrong; nothing was sent."""


class RecordError(rl.UsageError):
    """The call was made but its ledger line could not be written. `.record` holds what was received,
    the answer included, so a paid answer is never thrown away."""

    def __init__(self, message, record):
        super().__init__(message)
        self.record = record


class _CallFailed(Exception):
    """One attempt failed: carries what the ledger records about it."""

    def __init__(self, error_type, message, status=None, headers=None, code=None, redirect_host=None):
        super().__init__(message)
        self.error_type, self.message, self.status, self.headers = error_type, message, status, headers
        self.code, self.redirect_host = code, redirect_host


# ----------------------------------------------------------------------------
# Helpers: settings
# ----------------------------------------------------------------------------

def settings_from_env(base_url=None, model=None, api_key=None, environ=None, need_model=True):
    """(base_url, model, api_key) from flags, then BASE_URL/MODEL_ID/API_KEY and the OPENAI_* names.
    Raises ConfigError naming every setting that is missing, and refuses a malformed key or URL.
    There are no defaults."""
    env = os.environ if environ is None else environ
    base_url = base_url or env.get("BASE_URL") or env.get("OPENAI_BASE_URL")
    model = model or env.get("MODEL_ID")
    api_key = api_key or env.get("API_KEY") or env.get("OPENAI_API_KEY")
    missing = [name for name, value in (("BASE_URL", base_url), ("API_KEY", api_key), ("MODEL_ID", model))
               if not value and (need_model or name != "MODEL_ID")]
    if missing:
        names = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
        raise ConfigError(f"{names} {'is' if len(missing) == 1 else 'are'} not set; export BASE_URL (like "
                          f"https://host/v1), API_KEY (any value for servers that ignore it) and MODEL_ID (the exact "
                          f"model id); there are no defaults")
    check_api_key(api_key)
    split_base_url(base_url)
    return base_url, model, api_key


def check_api_key(api_key):
    """The key goes into an HTTP header: refuse what would break it or send something else."""
    if api_key != api_key.strip():
        raise ConfigError("API_KEY has white space or a line break around it; remove it (the key is not shown)")
    if not re.fullmatch(r"[\x21-\x7e]+", api_key):
        raise ConfigError("API_KEY must be printable ASCII without spaces or line breaks (the key is not shown)")


def split_base_url(base_url):
    """(request_base, recorded_base, host, port): the first keeps a query string (api-version=...),
    the recorded one drops user:password, query and fragment. Raises ConfigError for a bad URL."""
    safe = _safe_url(base_url)
    if re.search(r"[\x00-\x20\x7f]", base_url):
        raise ConfigError(f"BASE_URL has white space or a control character in it: {safe!r}")
    try:
        parts = urllib.parse.urlsplit(base_url)
    except ValueError:
        raise ConfigError(f"BASE_URL is not a URL: {safe!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"BASE_URL must be an http(s) URL like https://host/v1, not {safe!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        parts.hostname.encode("idna")
    except (ValueError, UnicodeError):
        raise ConfigError(f"BASE_URL has a bad host or port: {safe!r}") from None
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    path = parts.path.rstrip("/")
    recorded = urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))
    return (parts.scheme, netloc, path, parts.query), recorded, host, port


def _safe_url(url):
    """A URL fit for an error message: no query, fragment or credentials."""
    return rl.redact_text(re.split(r"[?#]", url, maxsplit=1)[0])


def _endpoint(request_base, suffix):
    scheme, netloc, path, query = request_base
    return urllib.parse.urlunsplit((scheme, netloc, path + suffix, query, ""))


def _check_number(name, value, minimum=None, above=None):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, not {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}")
    if above is not None and value <= above:
        raise ConfigError(f"{name} must be greater than {above}")


# ----------------------------------------------------------------------------
# Helpers: what a server says
# ----------------------------------------------------------------------------

def estimate_tokens(chars):
    return int(math.ceil(chars / 4)) if chars else 0


def _count(value):
    """A reported token count: a non-negative int, else None (never 0 by default, never a guess)."""
    return value if type(value) is int and 0 <= value < 2 ** 63 else None


def parse_usage(usage):
    """Reported usage only. Returns the fields and usage_status: complete/partial/zero/absent/malformed."""
    fields = {"usage_reported": False, "usage_status": "absent", "input_tokens": None, "output_tokens": None,
              "total_tokens": None, "cached_input_tokens": None, "reasoning_output_tokens": None}
    if usage is None:
        return fields
    if not isinstance(usage, dict):
        fields["usage_status"] = "malformed"
        return fields
    details_in = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    details_out = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    fields["input_tokens"] = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
    fields["output_tokens"] = _count(usage.get("completion_tokens", usage.get("output_tokens")))
    fields["total_tokens"] = _count(usage.get("total_tokens"))
    fields["cached_input_tokens"] = _count(details_in.get("cached_tokens")) if isinstance(details_in, dict) else None
    fields["reasoning_output_tokens"] = (_count(details_out.get("reasoning_tokens"))
                                         if isinstance(details_out, dict) else None)
    counts = [fields[k] for k in ("input_tokens", "output_tokens", "total_tokens")]
    if all(c is None for c in counts):
        fields["usage_status"] = "malformed"
        return fields
    fields["usage_reported"] = True
    if all(c == 0 for c in counts if c is not None):
        fields["usage_status"] = "zero"
    elif any(c is None for c in counts):
        fields["usage_status"] = "partial"
    else:
        fields["usage_status"] = "complete"
    return fields


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _server_text(value, where, problems, limit=None):
    """A string the server chose, made safe to record: None stays None; another type, a lone surrogate
    or (with `limit`) an over-long value is noted in `problems` and repaired."""
    if value is None:
        return None
    if type(value) is not str:
        problems.append(f"{where} is a {type(value).__name__}, not a string")
        return None
    if _SURROGATE_RE.search(value):
        problems.append(f"{where} holds a lone surrogate (not Unicode text)")
        value = _SURROGATE_RE.sub("\ufffd", value)
    if limit is not None and len(value) > limit:
        problems.append(f"{where} was cut from {len(value)} to {limit} characters")
        value = value[:limit]
    return value


def _content_text(content, where, problems):
    """The text of a message or delta `content`: a string, or a list of text parts."""
    if content is None:
        return ""
    if type(content) is list:
        texts = []
        for i, part in enumerate(content):
            if type(part) is not dict:
                problems.append(f"{where}[{i}] is a {type(part).__name__}, not a content part")
            elif part.get("type", "text") in ("text", "output_text"):
                texts.append(_server_text(part.get("text"), f"{where}[{i}].text", problems) or "")
        return "".join(texts)
    return _server_text(content, where, problems) or ""


def _ratelimit(headers):
    if headers is None:
        return {}
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if (low.startswith("x-ratelimit-") or low in ("retry-after", "retry-after-ms")) and len(out) < 32:
            out[low[:64]] = str(value)[:200]
    return out


def retry_after_seconds(headers, now=None):
    """The server's requested wait: retry-after-ms, or Retry-After in seconds or as an HTTP date."""
    if not headers:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = lower.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / scale
        except ValueError:
            if name == "retry-after-ms":
                continue
            import email.utils  # only on this rare path
            try:
                moment = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            if moment is None:
                return None
            seconds = moment.timestamp() - (time.time() if now is None else now)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    return None


def _error_from_body(raw, content_type):
    """(message, code): the server's own error message and code from a JSON body, the <title> of an
    HTML page, or the text."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            code = err.get("code")
            code = str(code)[:100] if isinstance(code, (str, int)) and not isinstance(code, bool) else None
            for name in ("message", "detail"):
                if isinstance(err.get(name), str) and err[name]:
                    return err[name], code
            return text, code
        if isinstance(err, str):
            return err, None
    if "html" in (content_type or "") or text.lower().startswith(("<!doctype html", "<html")):
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
        return "an HTML page" + (f" titled {title.group(1).strip()[:200]!r}" if title else ""), None
    return text, None


def _error_type_for_status(status):
    if status in (401, 403):
        return "auth_error"
    if status == 404:
        return "not_found"
    if status == 429:
        return "rate_limited"
    if status >= 500:
        return "server_error"
    return "http_error"


def _strip_fence(text):
    match = re.fullmatch(r"\s*```[a-zA-Z0-9_-]*\s*\n(.*?)\n?```\s*", text, re.S)
    return (match.group(1), True) if match else (text, False)


def run_checks(text, *, expect=None, expect_json=False, strict_model=False, request_model=None,
               response_model=None):
    """The assertion gate. Returns (check, detail): check is None when nothing was asked."""
    results = []
    if expect is not None:
        pattern = expect if hasattr(expect, "search") else re.compile(expect)
        ok = bool(pattern.search(text))
        results.append((ok, f"{'matched' if ok else 'no match for'} /{pattern.pattern}/"))
    if expect_json:
        body, fenced = _strip_fence(text)
        try:
            json.loads(body)
            results.append((True, "valid JSON" + (" (inside a ``` fence)" if fenced else "")))
        except (ValueError, RecursionError) as exc:
            results.append((False, f"not JSON: {exc}"))
    if strict_model:
        ok = response_model == request_model
        results.append((ok, f"served model {'is' if ok else 'is not'} the requested one "
                            f"({response_model!r} vs {request_model!r})"))
    if not results:
        return None, None
    return all(ok for ok, _ in results), "; ".join(detail for _, detail in results)


# ----------------------------------------------------------------------------
# Transport: no redirects, one deadline for the whole attempt, bounded reads
# ----------------------------------------------------------------------------

def _classify(exc, deadline):
    """(error_type, message) for a failure below a complete HTTP answer."""
    if deadline.expired:
        return "timeout", f"no complete answer within {deadline.seconds:g} s (--timeout bounds the whole attempt)"
    reason = getattr(exc, "reason", exc) if isinstance(exc, urllib.error.URLError) else exc
    import ssl  # already loaded by urllib.request
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timeout", "timed out"
    if isinstance(reason, socket.gaierror):
        return "dns_error", f"name resolution failed: {reason.strerror or reason}"
    if isinstance(reason, ConnectionRefusedError):
        return "connection_refused", "connection refused"
    if isinstance(reason, (ssl.SSLError, ssl.CertificateError)):
        return "tls_error", f"TLS error: {reason}"
    if isinstance(reason, http.client.IncompleteRead):
        return "truncated_response", f"the body was cut short ({len(reason.partial)} bytes arrived)"
    if isinstance(reason, http.client.HTTPException):
        detail = str(reason)[:200]
        return "connection_error", f"broken HTTP answer: {type(reason).__name__}{': ' + detail if detail else ''}"
    return "connection_error", f"{type(reason).__name__}: {reason}"


def _open(url, *, api_key, deadline, body=None):
    """Send one request; return the response of a 2xx. Raises _CallFailed for anything else."""
    headers = {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT, "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode("ascii")  # \\u escapes: any text, lone surrogates included, goes out
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        return rl.http_open(request, deadline)
    except urllib.error.HTTPError as exc:
        try:
            raw = _read_body(exc, MAX_ERROR_BODY_BYTES, deadline, tolerant=True)
        finally:
            exc.close()
        if 300 <= exc.code < 400:
            location = exc.headers.get("Location", "") if exc.headers else ""
            host = urllib.parse.urlsplit(location).netloc.rpartition("@")[2][:200] or "(no Location)"
            raise _CallFailed("redirect", f"HTTP {exc.code}: redirect to {host} not followed (the API key is "
                                          f"never sent to another URL; fix BASE_URL)", exc.code, exc.headers,
                              redirect_host=host) from None
        message, code = _error_from_body(raw, exc.headers.get("Content-Type", "") if exc.headers else "")
        raise _CallFailed(_error_type_for_status(exc.code), f"HTTP {exc.code}: {message or exc.reason}",
                          exc.code, exc.headers, code=code) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _CallFailed(*_classify(exc, deadline)) from None


def _read_body(response, limit, deadline, tolerant=False):
    """The body, at most `limit` bytes, checked against Content-Length. `tolerant` (error bodies)
    returns what arrived instead of failing."""
    status = getattr(response, "status", None) or getattr(response, "code", None)
    chunks, total = [], 0
    try:
        while True:
            chunk = response.read(min(65536, limit + 1 - total))
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                if tolerant:
                    break
                raise _CallFailed("response_too_large", f"the body is over the {limit}-byte limit "
                                                        f"(--max-response-bytes)", status, response.headers)
            chunks.append(chunk)
    except (OSError, http.client.HTTPException) as exc:
        if tolerant:
            return b"".join(chunks)
        raise _CallFailed(*_classify(exc, deadline), status, response.headers) from None
    if not tolerant and deadline.expired:
        raise _CallFailed(*_classify(None, deadline), status, response.headers)
    if not tolerant and getattr(response, "length", None):
        raise _CallFailed("truncated_response", f"the body ended {response.length} bytes short of its "
                                                f"Content-Length", status, response.headers)
    return b"".join(chunks)


def _parse_json(raw, what, problems, status, headers, content_type=""):
    """A JSON object from raw bytes. NaN and Infinity are noted in problems and read as null."""
    def constant(name):
        problems.append(f"{name} in the {what}")
        return None
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=constant)
    except UnicodeDecodeError:
        raise _CallFailed("invalid_json", f"HTTP {status} but the {what} is not UTF-8", status, headers) from None
    except ValueError:
        message, _code = _error_from_body(raw, content_type)
        error_type = "html_response" if message.startswith("an HTML page") else "invalid_json"
        raise _CallFailed(error_type, f"HTTP {status} but the {what} is not JSON: {message[:200]}", status,
                          headers) from None
    except RecursionError:
        raise _CallFailed("malformed_response", f"the {what} is nested too deeply to read", status, headers) \
            from None
    if not isinstance(data, dict):
        raise _CallFailed("invalid_json", f"HTTP {status} but the {what} is not a JSON object", status, headers)
    return data


def _api_error(err, status, headers, prefix):
    if isinstance(err, dict):
        message, code = err.get("message"), err.get("code")
        code = str(code)[:100] if isinstance(code, (str, int)) and not isinstance(code, bool) else None
    else:
        message, code = err, None
    raise _CallFailed("api_error", f"{prefix}: {str(message)[:MAX_ERROR_CHARS]}", status, headers, code=code)


# ----------------------------------------------------------------------------
# Core
# ----------------------------------------------------------------------------

def _sha256(text):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _new_record(model, recorded_base, host, port, stream, attempt, messages, options):
    system = [m["content"] for m in messages if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    system_chars = sum(map(len, system))
    prompt_chars = sum(len(m["content"]) for m in messages) - system_chars
    record = dict.fromkeys(MODEL_CALL_FIELDS)
    record.update(parse_usage(None))
    record.update({
        "request_model": model, "base_url": recorded_base, "server_address": host, "server_port": port,
        "stream": stream, "attempt": attempt,
        "prompt_sha256": _sha256(users[-1] if users else ""), "prompt_chars": prompt_chars,
        "system_chars": system_chars, "message_count": len(messages),
        "messages_sha256": _sha256(json.dumps(messages, ensure_ascii=False, separators=(",", ":"))),
        "est_input_tokens": estimate_tokens(prompt_chars + system_chars), "est_method": EST_METHOD,
        "ratelimit": {}, "temperature": options.get("temperature"), "max_tokens": options.get("max_tokens"),
    })
    if system:
        record["system_sha256"] = _sha256("\n".join(system))
    return record


def _fill_from_completion(record, data, problems, status, headers):
    """Fill `record` from a chat.completion object and return the answer text."""
    choices = data.get("choices")
    if data.get("error") is not None and not choices:
        _api_error(data["error"], status, headers, f"HTTP {status} with an error body")
    record["response_model"] = _server_text(data.get("model"), "model", problems, MAX_FIELD_CHARS)
    record["response_id"] = _server_text(data.get("id"), "id", problems, MAX_FIELD_CHARS)
    record["system_fingerprint"] = _server_text(data.get("system_fingerprint"), "system_fingerprint", problems,
                                                MAX_FIELD_CHARS)
    record.update(parse_usage(data.get("usage")))
    if not isinstance(choices, list) or not choices:
        raise _CallFailed("no_choices", f"HTTP {status} but the response has no choices", status, headers)
    choice = choices[0]
    if type(choice) is not dict:
        problems.append(f"choices[0] is a {type(choice).__name__}, not an object")
        return ""
    record["finish_reason"] = _server_text(choice.get("finish_reason"), "choices[0].finish_reason", problems,
                                           MAX_FIELD_CHARS)
    message = choice.get("message")
    if message is None:
        return ""
    if type(message) is not dict:
        problems.append(f"choices[0].message is a {type(message).__name__}, not an object")
        return ""
    return _content_text(message.get("content"), "choices[0].message.content", problems)


def _read_stream(response, record, started, on_text, limit, deadline, problems):
    """Read server-sent events to [DONE]; return the text. Lines and the whole body are capped."""
    parts, finished, done, usage, total = [], False, False, None, 0
    status, headers = response.status, response.headers
    try:
        while True:
            line = response.readline(MAX_SSE_LINE_BYTES + 1)
            if not line:
                break
            total += len(line)
            if total > limit or (len(line) > MAX_SSE_LINE_BYTES and not line.endswith(b"\n")):
                raise _CallFailed("response_too_large", f"the stream is over the {limit}-byte limit or has a line "
                                                        f"over {MAX_SSE_LINE_BYTES} bytes", status, headers)
            if not line.endswith(b"\n"):
                raise _CallFailed("truncated_stream", "the stream was cut in the middle of an event", status,
                                  headers)
            line = line.rstrip(b"\r\n")
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments, event:/id:/retry: fields
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = _parse_json(data, "stream chunk", problems, status, headers) if data[:1] == b"{" else None
            if chunk is None:
                problems.append(f"a stream chunk is not a JSON object: {data[:80]!r}")
                continue
            if chunk.get("error") is not None:
                _api_error(chunk["error"], status, headers, "error in the stream")
            for name, key in (("response_model", "model"), ("response_id", "id"),
                              ("system_fingerprint", "system_fingerprint")):
                value = _server_text(chunk.get(key), key, problems, MAX_FIELD_CHARS)
                if value is not None:
                    record[name] = value
            if chunk.get("usage") is not None:
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if type(choices) is not list:
                problems.append(f"a stream chunk's choices is a {type(choices).__name__}, not a list")
                continue
            for choice in choices:
                if type(choice) is not dict:
                    problems.append(f"a stream choice is a {type(choice).__name__}, not an object")
                    continue
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if type(delta) is not dict:
                    problems.append(f"a stream delta is a {type(delta).__name__}, not an object")
                    continue
                piece = _content_text(delta.get("content"), "delta.content", problems)
                if piece:
                    if record["ttft_ms"] is None:
                        record["ttft_ms"] = _ms_since(started)
                    parts.append(piece)
                    on_text(piece)
                if choice.get("finish_reason") is not None:
                    record["finish_reason"] = _server_text(choice["finish_reason"], "finish_reason", problems,
                                                           MAX_FIELD_CHARS)
                    finished = True
        if deadline.expired:
            raise _CallFailed(*_classify(None, deadline), status, headers)
    except (OSError, http.client.HTTPException) as exc:
        raise _CallFailed(*_classify(exc, deadline), status, headers) from None
    finally:
        record["response_chars"] = sum(map(len, parts))
        record["est_output_tokens"] = estimate_tokens(record["response_chars"])
        record.update(parse_usage(usage))
    if not (done or finished):
        raise _CallFailed("truncated_stream", "the stream ended without a finish_reason or [DONE]", status, headers)
    return "".join(parts)


def _one_attempt(url, body, record, started, *, api_key, deadline, limit, on_text, problems):
    """Send once; fill `record` (all but latency_ms); return the answer text. Raises _CallFailed."""
    response = _open(url, api_key=api_key, deadline=deadline, body=body)
    with response:
        record["http_status"] = response.status
        record["request_id"] = _server_text(response.headers.get("x-request-id") or response.headers.get(
            "request-id"), "request-id header", problems, MAX_FIELD_CHARS)
        record["ratelimit"] = _ratelimit(response.headers)
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _CallFailed("response_too_large", f"the body announces {declared} bytes, over the {limit}-byte "
                                                    f"limit (--max-response-bytes)", response.status, response.headers)
        if body.get("stream"):
            return _read_stream(response, record, started, on_text, limit, deadline, problems)
        raw = _read_body(response, limit, deadline)
        data = _parse_json(raw, "body", problems, response.status, response.headers,
                           response.headers.get("Content-Type", ""))
        return _fill_from_completion(record, data, problems, response.status, response.headers)


def _ms_since(started):
    return round((time.perf_counter() - started) * 1000, 1)


def _record_failure(record, failure, redactor):
    record["error_type"] = failure.error_type
    record["error_message"] = redactor.text(failure.message)[:MAX_ERROR_CHARS]
    if failure.code is not None:
        record["error_code"] = redactor.text(failure.code)
    if failure.status is not None:
        record["http_status"] = failure.status
    if failure.redirect_host:
        record["redirect_host"] = failure.redirect_host
    if failure.headers is not None:
        problems = []
        record["request_id"] = _server_text(failure.headers.get("x-request-id") or failure.headers.get(
            "request-id"), "request-id header", problems, MAX_FIELD_CHARS)
        record["ratelimit"] = _ratelimit(failure.headers)


def _wait_before_retry(attempt, failure, backoff, max_wait):
    server_wait = retry_after_seconds(failure.headers)
    if server_wait is not None:
        return min(server_wait, max_wait)
    return min(max_wait, backoff * (2 ** (attempt - 1)) * random.uniform(0.5, 1.0))


def retryable(record):
    """Whether a failed attempt (its record) is worth retrying: a timeout, a dropped or cut answer, a busy
    or broken server. A client error (bad key, unknown model, a malformed answer) is not."""
    return record["error_type"] in RETRYABLE_ERRORS or record["http_status"] in RETRYABLE_STATUS


def _ledger_for(ledger, api_key):
    """(Ledger, owned): a Ledger, a Run's ledger, or a new Ledger on a path (closed by us)."""
    if isinstance(ledger, rl.Run):
        ledger = ledger.ledger
    if isinstance(ledger, rl.Ledger):
        ledger.add_secret(api_key)
        return ledger, False
    if isinstance(ledger, (str, os.PathLike)):
        run_id = os.environ.get("LEDGER_RUN_ID") or None
        return rl.Ledger(ledger, run_id, secrets=(api_key,)), True
    raise TypeError(f"ledger must be a Ledger, a Run or a path, not a {type(ledger).__name__}")


def _append(book, kind, record):
    try:
        book.append(kind, record)
    except (rl.LedgerError, OSError) as exc:
        raise RecordError(f"the call was made but its ledger line could not be written: "
                          f"{rl.error_text(exc)}", record) from exc


def _check_messages(messages):
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list of {role, content}")
    for i, message in enumerate(messages):
        if (type(message) is not dict or type(message.get("role")) is not str
                or type(message.get("content")) is not str):
            raise ConfigError(f"messages[{i}] must be {{\"role\": str, \"content\": str}}")
    if not any(m["role"] != "system" and m["content"].strip() for m in messages):
        raise ConfigError("the prompt is empty")


class _Printer:
    """Calls the caller's on_text; if it raises, stops calling it and keeps the exception, so the
    attempt still ends in its ledger line before the exception is raised again."""

    def __init__(self, on_text):
        self.on_text, self.raised, self.printed = on_text, None, False

    def __call__(self, piece):
        if self.on_text is None or self.raised is not None:
            return
        self.printed = True
        try:
            self.on_text(piece)
        except Exception as exc:  # the caller's code: kept, and raised again once the line is written
            self.raised = exc


def chat(messages, *, ledger, base_url, model, api_key, max_tokens=None, temperature=None, stream=False,
         retries=0, timeout=DEFAULT_TIMEOUT, expect=None, expect_json=False, strict_model=False,
         store_text=False, backoff=1.0, max_wait=60.0, max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES,
         on_text=None, on_retry=None, sleep=time.sleep):
    """Send `messages` to {base_url}/chat/completions as `model`; append one model_call event per attempt
    to `ledger` (a Ledger, a Run, or a path). Returns the last attempt's record, as logged, plus "text"
    (the answer; also kept for a malformed_response). Endpoint failures do not raise: they are in the
    record. Raises ConfigError before anything is sent (settings, arguments, a ledger that cannot take
    the line), and RecordError when the line of a finished call cannot be written.
    `timeout` bounds each whole attempt; on_retry(record, wait) is told before each retry."""
    if not model:
        raise ConfigError("MODEL_ID is not set (export MODEL_ID=..., or pass --model); there is no default")
    _check_messages(messages)
    check_api_key(api_key)
    request_base, recorded_base, host, port = split_base_url(base_url)
    _check_number("temperature", temperature)
    _check_number("timeout", timeout, above=0)
    _check_number("max_wait", max_wait, minimum=0)
    _check_number("backoff", backoff, minimum=0)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise ConfigError("max_tokens must be a positive integer")
    if type(retries) is not int or retries < 0:
        raise ConfigError("retries must be a non-negative integer")
    if type(max_response_bytes) is not int or max_response_bytes < 1024:
        raise ConfigError("max_response_bytes must be an integer of at least 1024")
    if expect is not None and not hasattr(expect, "search"):
        try:
            expect = re.compile(expect)
        except re.error as exc:
            raise ConfigError(f"--expect is not a valid regular expression: {exc}") from None
    url = _endpoint(request_base, "/chat/completions")
    body = {"model": model, "messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    options = {"temperature": temperature, "max_tokens": max_tokens}
    book, owned = _ledger_for(ledger, api_key)
    try:
        try:
            book.check()  # a ledger that cannot take the line costs no request
        except (rl.LedgerError, OSError) as exc:
            raise ConfigError(f"the ledger cannot take a line, so nothing was sent: {rl.error_text(exc)}") from None
        return _attempts(book, url, body, messages, model, recorded_base, host, port, options, api_key,
                         retries=retries, timeout=timeout, expect=expect, expect_json=expect_json,
                         strict_model=strict_model, store_text=store_text, backoff=backoff, max_wait=max_wait,
                         limit=max_response_bytes, on_text=on_text, on_retry=on_retry, sleep=sleep)
    finally:
        if owned:
            book.close()


def _attempts(book, url, body, messages, model, recorded_base, host, port, options, api_key, *, retries,
              timeout, expect, expect_json, strict_model, store_text, backoff, max_wait, limit, on_text,
              on_retry, sleep):
    artifacts = {}
    if store_text:
        users = [m["content"] for m in messages if m["role"] == "user"]
        system = "\n".join(m["content"] for m in messages if m["role"] == "system")
        artifacts["prompt_artifact"] = book.store_artifact(users[-1] if users else "")
        if system:
            artifacts["system_artifact"] = book.store_artifact(system)
        if len(messages) > len(users[-1:]) + (1 if system else 0):
            artifacts["messages_artifact"] = book.store_artifact(json.dumps(messages, ensure_ascii=False, indent=1))
    redactor = book.redactor
    attempt, dropped_options = 0, False
    while True:
        attempt += 1
        record = _new_record(model, recorded_base, host, port, bool(body.get("stream")), attempt, messages,
                             options)
        record.update(artifacts)
        if dropped_options:
            record["stream_options_dropped"] = True
        text, failure, problems = None, None, []
        printer = _Printer(on_text)
        started = time.perf_counter()
        deadline = rl.Deadline(timeout)
        try:
            text = _one_attempt(url, body, record, started, api_key=api_key, deadline=deadline, limit=limit,
                                on_text=printer, problems=problems)
        except _CallFailed as exc:
            failure = exc
        finally:
            deadline.cancel()
        record["latency_ms"] = _ms_since(started)  # to the end of the body, or to the failure
        if text is not None and not record["stream"]:
            record["response_chars"] = len(text)
            record["est_output_tokens"] = estimate_tokens(len(text))
        if problems:
            record["malformed"] = problems[:MAX_PROBLEMS]
            if failure is None:
                failure = _CallFailed("malformed_response", "the answer arrived but the body is malformed: "
                                      + "; ".join(problems[:3]), record["http_status"])
        if failure is None and not text.strip():
            failure = _CallFailed("empty_content", f"HTTP {record['http_status']} but the answer is empty",
                                  record["http_status"])
        if failure is not None:
            _record_failure(record, failure, redactor)
        elif expect is not None or expect_json or strict_model:
            record["check"], record["check_detail"] = run_checks(
                text, expect=expect, expect_json=expect_json, strict_model=strict_model,
                request_model=model, response_model=record["response_model"])
        if text and store_text:
            record["response_artifact"] = book.store_artifact(text)
        wait = None
        retry_options = (failure is not None and body.get("stream") and not dropped_options
                         and failure.status in (400, 422) and "stream_options" in (failure.message or ""))
        if retry_options:
            record["retry_reason"] = "server rejected stream_options; retrying once without it"
            wait = 0.0
        elif failure is not None and not printer.printed and retryable(record) and attempt <= retries:
            wait = _wait_before_retry(attempt, failure, backoff, max_wait)
            record["retry_in_s"] = round(wait, 3)
            record["retry_reason"] = f"{failure.error_type}: {record['error_message']}"[:MAX_ERROR_CHARS]
        keep_text = failure is None or failure.error_type == "malformed_response"
        result = dict(record, text=text if keep_text else None)
        try:
            _append(book, "model_call", record)
        except RecordError as exc:
            exc.record = result
            raise
        if printer.raised is not None:
            raise printer.raised
        if wait is None:
            return result
        if retry_options:
            dropped_options = True
            body.pop("stream_options", None)
        if on_retry is not None:
            on_retry(result, wait)
        sleep(wait)


def ask(prompt, *, system=None, **kwargs):
    """One prompt (and an optional system prompt) through chat(). Same arguments and result."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("the prompt is empty")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return chat(messages, **kwargs)


def list_models(*, ledger, base_url, api_key, timeout=DEFAULT_TIMEOUT, max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES):
    """GET {base_url}/models; append one models_list event; return its record (model_ids sorted, and
    context_tokens {id: window} for the models whose entry states a window)."""
    check_api_key(api_key)
    request_base, recorded_base, host, port = split_base_url(base_url)
    _check_number("timeout", timeout, above=0)
    record = {"base_url": recorded_base, "server_address": host, "server_port": port, "http_status": None,
              "model_ids": None, "count": None, "latency_ms": None, "request_id": None, "ratelimit": {},
              "error_type": None, "error_code": None, "error_message": None}
    book, owned = _ledger_for(ledger, api_key)
    try:
        try:
            book.check()
        except (rl.LedgerError, OSError) as exc:
            raise ConfigError(f"the ledger cannot take a line, so nothing was sent: {rl.error_text(exc)}") from None
        started = time.perf_counter()
        deadline = rl.Deadline(timeout)
        problems = []
        try:
            response = _open(_endpoint(request_base, "/models"), api_key=api_key, deadline=deadline)
            with response:
                record["http_status"] = response.status
                record["ratelimit"] = _ratelimit(response.headers)
                raw = _read_body(response, max_response_bytes, deadline)
                data = _parse_json(raw, "body", problems, response.status, response.headers,
                                   response.headers.get("Content-Type", ""))
            items = data.get("data")
            if not isinstance(items, list):
                raise _CallFailed("invalid_json", "HTTP 200 but the body has no data list", 200)
            ids = {_server_text(item.get("id"), "data[].id", problems, MAX_FIELD_CHARS)
                   for item in items if isinstance(item, dict)}
            ids.discard(None)
            record["model_ids"], record["count"] = sorted(ids)[:10000], len(ids)
            windows = {item["id"]: _listed_window(item) for item in items if isinstance(item, dict)
                       and item.get("id") in ids and _listed_window(item)}
            if windows:
                record["context_tokens"] = dict(sorted(windows.items())[:10000])
            if problems:
                record["malformed"] = problems[:MAX_PROBLEMS]
        except _CallFailed as exc:
            _record_failure(record, exc, book.redactor)
        finally:
            deadline.cancel()
        record["latency_ms"] = _ms_since(started)
        _append(book, "models_list", record)
    finally:
        if owned:
            book.close()
    return record


def _listed_window(item):
    """A model's context window in tokens as a /models entry states it: vLLM's max_model_len, llama.cpp's
    meta.n_ctx_train, or context_length (OpenRouter, LM Studio); None when it states none."""
    meta = item.get("meta") if isinstance(item.get("meta"), dict) else {}
    for value in (item.get("max_model_len"), meta.get("n_ctx_train"), item.get("context_length")):
        if type(value) is int and value > 0:
            return value
    return None


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _read_prompt(source):
    if source in (None, "-"):
        if source is None and sys.stdin.isatty():
            raise ConfigError("no prompt: pipe one in (python ask.py < prompt.txt) or name a file")
        data = sys.stdin.buffer.read()
    else:
        with open(source, "rb") as handle:
            data = handle.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the prompt is not UTF-8 (byte {exc.start})") from None


def _build_parser():
    p = rl.ArgumentParser(
        prog="ask.py", description="One OpenAI-compatible call, one ledger line per attempt.",
        epilog=rl.exit_codes_epilog(rl.EXIT_OK, rl.EXIT_FAILED, rl.EXIT_USAGE, rl.EXIT_CHECK, rl.EXIT_OUTPUT),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt_file", nargs="?", help="a file with the prompt, or - for stdin (default: stdin)")
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("--model", help="the model id to pin (default $MODEL_ID)")
    p.add_argument("--base-url", help="default $BASE_URL, then $OPENAI_BASE_URL")
    p.add_argument("--ledger", help=f"default $LEDGER, then ./{DEFAULT_LEDGER}")
    p.add_argument("--models", action="store_true", help="list the endpoint's model ids instead of asking")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--stream", action="store_true", help="stream the answer; records time-to-first-token")
    p.add_argument("--retries", type=int, default=0, help="retries on 408/409/429/5xx/timeouts/broken answers "
                                                          "(default 0)")
    p.add_argument("--backoff", type=float, default=1.0, help="first retry wait in seconds, doubled each time")
    p.add_argument("--max-wait", type=float, default=60.0, help="cap on any one wait, Retry-After included")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds for a whole attempt, connect to last byte (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--max-response-bytes", type=int, default=DEFAULT_MAX_RESPONSE_BYTES,
                   help=f"largest body or stream accepted (default {DEFAULT_MAX_RESPONSE_BYTES})")
    p.add_argument("--expect", metavar="REGEX", help="the answer must match this regex (else exit 3)")
    p.add_argument("--expect-json", action="store_true", help="the answer must be JSON (else exit 3)")
    p.add_argument("--strict-model", action="store_true",
                   help="the served model must equal the requested one (else exit 3)")
    p.add_argument("--store-text", action="store_true", help="keep prompt and answer as artifacts")
    p.add_argument("--json", action="store_true", help="print the whole record instead of the text")
    return p


class _StreamOut:
    """Prints a stream as it arrives; a stdout that fails stops the printing, not the call."""

    def __init__(self):
        self.failed = None

    def __call__(self, piece):
        if self.failed is None:
            try:
                rl.write_out(piece)
            except rl.OutputError as exc:
                self.failed = exc


def _run(args):
    secrets = []
    base_url, model, api_key = settings_from_env(args.base_url, args.model, need_model=not args.models)
    secrets.append(api_key)
    for name, value, minimum in (("--retries", args.retries, 0), ("--max-wait", args.max_wait, 0),
                                 ("--backoff", args.backoff, 0), ("--max-tokens", args.max_tokens, 1)):
        _check_number(name, value, minimum=minimum)
    _check_number("--timeout", args.timeout, above=0)
    _check_number("--temperature", args.temperature)
    ledger_path = args.ledger or os.environ.get("LEDGER") or DEFAULT_LEDGER
    if args.models:
        record = list_models(ledger=ledger_path, base_url=base_url, api_key=api_key, timeout=args.timeout,
                             max_response_bytes=args.max_response_bytes)
        if record["error_type"]:
            rl.error(f"{record['error_type']}: {record['error_message']} ({record['base_url']})", secrets)
            return rl.EXIT_FAILED
        rl.write_out(json.dumps(record, ensure_ascii=False) + "\n" if args.json
                     else "".join(rl.printable(m) + "\n" for m in record["model_ids"]))
        return rl.EXIT_OK
    prompt = _read_prompt(args.prompt_file)
    stream_out = _StreamOut() if args.stream and not args.json else None

    def announce_retry(result, wait):
        rl.warn(f"attempt {result['attempt']} failed ({result['error_type']}: {result['error_message']}); "
                f"retrying in {wait:.2f} s", secrets)

    try:
        record = ask(prompt, ledger=ledger_path, base_url=base_url, model=model, api_key=api_key,
                     system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                     stream=args.stream, retries=args.retries, timeout=args.timeout, expect=args.expect,
                     expect_json=args.expect_json, strict_model=args.strict_model, store_text=args.store_text,
                     backoff=args.backoff, max_wait=args.max_wait, max_response_bytes=args.max_response_bytes,
                     on_text=stream_out, on_retry=announce_retry)
    except RecordError as exc:
        if exc.record.get("text") and not args.stream:
            _print_answer(exc.record, args)  # a paid answer is never thrown away
        raise
    output_failed = stream_out.failed if stream_out else None
    try:
        _print_answer(record, args)
    except rl.OutputError as exc:
        output_failed = exc
    if record["response_model"] and record["response_model"] != model:
        rl.warn(f"asked for {model!r}, the server says it ran {record['response_model']!r}", secrets)
    if output_failed is not None:
        rl.error(f"{output_failed} (the call is recorded in {ledger_path})", secrets)
        return rl.EXIT_OUTPUT
    if record["error_type"]:
        rl.error(f"{record['error_type']}: {record['error_message']} ({record['base_url']}, attempt "
                 f"{record['attempt']})", secrets)
        return rl.EXIT_FAILED
    if record["usage_status"] != "complete" and not args.json:
        rl.warn(f"usage {record['usage_status']}: token counts are not fully reported; "
                f"estimates ({EST_METHOD}) are recorded separately", secrets)
    if record["check"] is False:
        rl.error(f"check failed: {record['check_detail']}", secrets)
        return rl.EXIT_CHECK
    return rl.EXIT_OK


def _print_answer(record, args):
    if args.json:
        rl.write_out(json.dumps(record, ensure_ascii=False) + "\n")
    elif record.get("text"):
        ending = "" if record["text"].endswith("\n") else "\n"
        rl.write_out(ending if args.stream else record["text"] + ending)


def main(argv=None):
    args, code = rl.parse_cli(_build_parser(), argv)
    if args is None:
        return code
    secrets = [os.environ.get(name) for name in ("API_KEY", "OPENAI_API_KEY")]
    return rl.run_cli(_run, args, secrets=[s for s in secrets if s])


if __name__ == "__main__":
    sys.exit(main())
