#!/usr/bin/env python3
"""ask.py -- one call to an OpenAI-compatible endpoint, one ledger line per attempt. Stdlib only.

Usage:
  python ask.py < prompt.txt                      # the answer on stdout, a model_call line in the ledger
  python ask.py prompt.txt --expect '\\b4\\b'       # assertion gate: exit 3 when the answer does not match
  python ask.py --expect-json --retries 3 < prompt.txt
  python ask.py --stream < prompt.txt             # print as it arrives; records time-to-first-token
  python ask.py --models                          # is my key and base URL right? lists the model ids

Settings (environment; flags override): BASE_URL or OPENAI_BASE_URL, API_KEY or OPENAI_API_KEY,
MODEL_ID (--model), LEDGER (--ledger, default ./runs.jsonl), LEDGER_RUN_ID, LEDGER_KEY.
Exit codes: 0 ok, 1 transport/API failure, 2 usage/config/ledger error, 3 answer received but a check failed.
"""

import argparse
import hashlib
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

import reasoning_ledger

__version__ = "1.0.0"

# ----------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CHECK = 0, 1, 2, 3
DEFAULT_LEDGER = "runs.jsonl"
DEFAULT_TIMEOUT = 120.0
EST_METHOD = "chars/4"
MAX_ERROR_CHARS = 500
RETRYABLE_STATUS = {408, 409, 429}
RETRYABLE_ERRORS = {"timeout", "connection_refused", "connection_error", "rate_limited", "server_error"}
USER_AGENT = f"reasoning-ledger-ask/{__version__}"


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------

class AskError(Exception):
    """Base of what ask.py raises."""


class ConfigError(AskError):
    """A setting is missing or wrong; nothing was sent."""


class _CallFailed(Exception):
    """One attempt failed: carries what the ledger records about it."""

    def __init__(self, error_type, message, status=None, headers=None):
        super().__init__(message)
        self.error_type, self.message, self.status, self.headers = error_type, message, status, headers


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------

def settings_from_env(base_url=None, model=None, api_key=None, environ=None):
    """(base_url, model, api_key) from flags, then BASE_URL/MODEL_ID/API_KEY and the OPENAI_* names.
    Raises ConfigError naming the variable that is missing. There are no defaults."""
    env = os.environ if environ is None else environ
    base_url = base_url or env.get("BASE_URL") or env.get("OPENAI_BASE_URL")
    model = model or env.get("MODEL_ID")
    api_key = api_key or env.get("API_KEY") or env.get("OPENAI_API_KEY")
    if not base_url:
        raise ConfigError("BASE_URL is not set (export BASE_URL=https://host/v1, or pass --base-url)")
    if not api_key:
        raise ConfigError("API_KEY is not set (export API_KEY=...; any value for servers that ignore it)")
    return base_url, model, api_key


def split_base_url(base_url):
    """(request_base, recorded_base, host, port): the first keeps a query string (api-version=...),
    the recorded one drops user:password, query and fragment."""
    parts = urllib.parse.urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"BASE_URL must be an http(s) URL like https://host/v1, not {_safe_url(base_url)!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"BASE_URL has a bad port: {_safe_url(base_url)!r}") from None
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    path = parts.path.rstrip("/")
    recorded = urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))
    return (parts.scheme, netloc, path, parts.query), recorded, host, port


def _safe_url(url):
    return reasoning_ledger.redact_text(url.split("?")[0])


def _endpoint(request_base, suffix):
    scheme, netloc, path, query = request_base
    return urllib.parse.urlunsplit((scheme, netloc, path + suffix, query, ""))


def estimate_tokens(chars):
    return int(math.ceil(chars / 4)) if chars else 0


def _count(value):
    """A reported token count: a non-negative int, else None (never 0 by default, never a guess)."""
    return value if type(value) is int and value >= 0 else None


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


def _ms_since(started):
    return round((time.perf_counter() - started) * 1000, 1)


def _record_headers(record, headers):
    """request_id and the rate-limit headers, from a response or an HTTP error alike."""
    if headers is not None:
        record["request_id"] = headers.get("x-request-id") or headers.get("request-id")
        record["ratelimit"] = _ratelimit(headers)


def _record_failure(record, failure, secrets):
    record["error_type"] = failure.error_type
    record["error_message"] = reasoning_ledger.redact_text(
        failure.message, reasoning_ledger.secret_values(secrets))[:MAX_ERROR_CHARS]
    if failure.status is not None:
        record["http_status"] = failure.status
    _record_headers(record, failure.headers)


def _ratelimit(headers):
    if headers is None:
        return {}
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low.startswith("x-ratelimit-") or low in ("retry-after", "retry-after-ms"):
            out[low] = value
    return out


def retry_after_seconds(headers, now=None):
    """The server's requested wait: retry-after-ms, or Retry-After in seconds or as an HTTP date."""
    if not headers:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    value = lower.get("retry-after-ms")
    if value is not None:
        try:
            return max(0.0, float(value) / 1000.0)
        except ValueError:
            pass
    value = lower.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    import email.utils  # only on this rare path
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if moment is None:
        return None
    return max(0.0, moment.timestamp() - (time.time() if now is None else now))


def _message_from_body(raw, content_type):
    """The server's own error message: error.message from JSON, the <title> of an HTML page, or text."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if data.get("detail"):
            return str(data["detail"])
    if "html" in (content_type or "") or text.lower().startswith(("<!doctype html", "<html")):
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
        return "an HTML page" + (f" titled {title.group(1).strip()!r}" if title else "")
    return text


def _classify_os_error(exc):
    """error_type for a failure below HTTP: DNS, refused, TLS, timeout, other connection trouble."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, socket.timeout) or isinstance(reason, TimeoutError):
        return "timeout", "timed out"
    if isinstance(reason, socket.gaierror):
        return "dns_error", f"name resolution failed: {reason.strerror or reason}"
    if isinstance(reason, ConnectionRefusedError):
        return "connection_refused", "connection refused"
    import ssl  # already loaded by urllib.request; imported here for the name only
    if isinstance(reason, (ssl.SSLError, ssl.CertificateError)):
        return "tls_error", f"TLS error: {reason}"
    return "connection_error", f"{type(reason).__name__}: {reason}"


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
        except ValueError as exc:
            results.append((False, f"not JSON: {exc}"))
    if strict_model:
        ok = response_model == request_model
        results.append((ok, f"served model {'is' if ok else 'is not'} the requested one "
                            f"({response_model!r} vs {request_model!r})"))
    if not results:
        return None, None
    return all(ok for ok, _ in results), "; ".join(detail for _, detail in results)


# ----------------------------------------------------------------------------
# Transport
# ----------------------------------------------------------------------------

def _open(url, *, api_key, timeout, body=None):
    headers = {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT, "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            raw = exc.read()
        except (OSError, socket.timeout):
            raw = b""
        message = _message_from_body(raw, exc.headers.get("Content-Type", "") if exc.headers else "")
        raise _CallFailed(_error_type_for_status(exc.code), f"HTTP {exc.code}: {message or exc.reason}",
                          exc.code, exc.headers) from None
    except (urllib.error.URLError, OSError) as exc:
        error_type, message = _classify_os_error(exc)
        raise _CallFailed(error_type, message) from None


def _read_json(response):
    """Body of a 200 response as a JSON object; the transport gate's second half."""
    try:
        raw = response.read()
    except (socket.timeout, TimeoutError):
        raise _CallFailed("timeout", "timed out reading the response", 200, response.headers) from None
    except OSError as exc:
        raise _CallFailed("connection_error", f"connection lost reading the response: {exc}", 200,
                          response.headers) from None
    content_type = response.headers.get("Content-Type", "")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        what = _message_from_body(raw, content_type)
        error_type = "html_response" if what.startswith("an HTML page") else "invalid_json"
        raise _CallFailed(error_type, f"HTTP 200 but the body is not JSON: {what[:200]}", 200,
                          response.headers) from None
    if not isinstance(data, dict):
        raise _CallFailed("invalid_json", "HTTP 200 but the body is not a JSON object", 200, response.headers)
    return data


def _sse_events(response):
    """Yield the JSON payload of each `data:` line; returns normally on [DONE] or end of stream."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        try:
            yield json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise _CallFailed("invalid_json", f"stream chunk is not JSON: {data[:120]!r}", 200,
                              response.headers) from None


# ----------------------------------------------------------------------------
# Core
# ----------------------------------------------------------------------------

def _base_record(request_model, recorded_base, host, port, stream, attempt, prompt, system, options):
    prompt_chars = len(prompt)
    system_chars = len(system) if system else 0
    record = {
        "request_model": request_model, "response_model": None, "response_id": None,
        "system_fingerprint": None, "base_url": recorded_base, "server_address": host, "server_port": port,
        "stream": stream, "attempt": attempt,
        "prompt_sha256": hashlib.sha256(prompt.encode("utf-8")).hexdigest(),
        "prompt_chars": prompt_chars, "system_chars": system_chars, "response_chars": None,
    }
    record.update(parse_usage(None))
    record.update({
        "est_input_tokens": estimate_tokens(prompt_chars + system_chars), "est_output_tokens": None,
        "est_method": EST_METHOD, "latency_ms": None, "ttft_ms": None, "http_status": None,
        "finish_reason": None, "request_id": None, "ratelimit": {}, "error_type": None, "error_message": None,
        "check": None, "check_detail": None,
        "temperature": options.get("temperature"), "max_tokens": options.get("max_tokens"),
    })
    if system:
        record["system_sha256"] = hashlib.sha256(system.encode("utf-8")).hexdigest()
    return record


def _fill_from_completion(record, data):
    choices = data.get("choices")
    if data.get("error") and not choices:
        err = data["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise _CallFailed("api_error", f"HTTP 200 with an error body: {message}", 200)
    record["response_model"] = data.get("model") if isinstance(data.get("model"), str) else None
    record["response_id"] = data.get("id") if isinstance(data.get("id"), str) else None
    record["system_fingerprint"] = data.get("system_fingerprint") if isinstance(
        data.get("system_fingerprint"), str) else None
    record.update(parse_usage(data.get("usage")))
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _CallFailed("no_choices", "HTTP 200 but the response has no choices", 200)
    choice = choices[0]
    record["finish_reason"] = choice.get("finish_reason")
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _one_attempt(url, body, record, started, *, api_key, timeout, on_text):
    """Send once; fill `record` (all but latency_ms); return the answer text. Raises _CallFailed."""
    response = _open(url, api_key=api_key, timeout=timeout, body=body)
    with response:
        record["http_status"] = response.status
        _record_headers(record, response.headers)
        if body.get("stream"):
            return _read_stream(response, record, started, on_text)
        return _fill_from_completion(record, _read_json(response))


def _read_stream(response, record, started, on_text):
    parts, finished, done = [], False, False
    usage = None
    try:
        for chunk in _sse_events(response):
            if chunk is None:
                done = True
                break
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                err = chunk["error"]
                raise _CallFailed("api_error", "error in stream: " + str(
                    err.get("message") if isinstance(err, dict) else err), 200)
            for name, key in (("response_model", "model"), ("response_id", "id"),
                              ("system_fingerprint", "system_fingerprint")):
                if isinstance(chunk.get(key), str):
                    record[name] = chunk[key]
            if chunk.get("usage") is not None:
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                piece = (choice.get("delta") or {}).get("content")
                if isinstance(piece, str) and piece:
                    if record["ttft_ms"] is None:
                        record["ttft_ms"] = _ms_since(started)
                    parts.append(piece)
                    if on_text:
                        on_text(piece)
                if choice.get("finish_reason"):
                    record["finish_reason"] = choice["finish_reason"]
                    finished = True
    except (socket.timeout, TimeoutError):
        raise _CallFailed("timeout", "timed out in the middle of the stream", 200) from None
    except OSError as exc:
        raise _CallFailed("truncated_stream", f"stream broke off: {type(exc).__name__}", 200) from None
    finally:
        record["response_chars"] = sum(map(len, parts))
        record["est_output_tokens"] = estimate_tokens(record["response_chars"])
        record.update(parse_usage(usage))
    if not (done or finished):
        raise _CallFailed("truncated_stream", "the stream ended without a finish_reason or [DONE]", 200)
    return "".join(parts)


def _wait_before_retry(attempt, failure, backoff, max_wait):
    server_wait = retry_after_seconds(failure.headers)
    if server_wait is not None:
        return min(server_wait, max_wait)
    return min(max_wait, backoff * (2 ** (attempt - 1)) * random.uniform(0.5, 1.0))


def _retryable(failure):
    return failure.error_type in RETRYABLE_ERRORS or failure.status in RETRYABLE_STATUS


def _open_ledger(ledger, api_key):
    if isinstance(ledger, reasoning_ledger.Ledger):
        ledger.add_secret(api_key)
        return ledger, False
    run_id = os.environ.get("LEDGER_RUN_ID") or None
    return reasoning_ledger.Ledger(ledger, run_id, secrets=(api_key,)), True


def ask(prompt, *, ledger, base_url, model, api_key, system=None, max_tokens=None, temperature=None,
        stream=False, retries=0, timeout=DEFAULT_TIMEOUT, expect=None, expect_json=False,
        strict_model=False, store_text=False, backoff=1.0, max_wait=60.0, on_text=None, sleep=time.sleep):
    """Send `prompt` to {base_url}/chat/completions as `model`; append one model_call event per attempt
    to `ledger` (a Ledger or a path). Returns the last attempt's record, as logged, plus "text".
    Raises ConfigError (nothing sent) and the ledger's errors (LedgerError, OSError)."""
    if not model:
        raise ConfigError("MODEL_ID is not set (export MODEL_ID=..., or pass --model); there is no default")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("the prompt is empty")
    request_base, recorded_base, host, port = split_base_url(base_url)
    if expect is not None and not hasattr(expect, "search"):
        try:
            expect = re.compile(expect)
        except re.error as exc:
            raise ConfigError(f"--expect is not a valid regular expression: {exc}") from None
    url = _endpoint(request_base, "/chat/completions")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    options = {"temperature": temperature, "max_tokens": max_tokens}
    book, owned = _open_ledger(ledger, api_key)
    artifacts = {}
    if store_text:
        artifacts["prompt_artifact"] = book.store_artifact(prompt)
        if system:
            artifacts["system_artifact"] = book.store_artifact(system)
    secrets = [api_key]
    try:
        attempt, dropped_options = 0, False
        while True:
            attempt += 1
            record = _base_record(model, recorded_base, host, port, stream, attempt, prompt, system, options)
            record.update(artifacts)
            if dropped_options:
                record["stream_options_dropped"] = True
            text, failure = None, None
            started = time.perf_counter()
            try:
                text = _one_attempt(url, body, record, started, api_key=api_key, timeout=timeout, on_text=on_text)
            except _CallFailed as exc:
                failure = exc
                _record_failure(record, exc, secrets)
            record["latency_ms"] = _ms_since(started)  # to the end of the body, or to the failure
            if failure is None:
                record["response_chars"] = len(text)
                record["est_output_tokens"] = estimate_tokens(len(text))
                if not text.strip():
                    failure = _CallFailed("empty_content", "HTTP 200 but the answer is empty", 200)
                    _record_failure(record, failure, secrets)
                else:
                    record["check"], record["check_detail"] = run_checks(
                        text, expect=expect, expect_json=expect_json, strict_model=strict_model,
                        request_model=model, response_model=record["response_model"])
                    if store_text:
                        record["response_artifact"] = book.store_artifact(text)
            wait = None
            retry_options = (failure is not None and stream and not dropped_options and failure.status in (400, 422)
                             and "stream_options" in (failure.message or ""))
            if retry_options:
                record["retry_reason"] = "server rejected stream_options; retrying once without it"
            elif failure is not None and _retryable(failure) and attempt <= retries:
                wait = _wait_before_retry(attempt, failure, backoff, max_wait)
                record["retry_in_s"] = round(wait, 3)
            book.append("model_call", record)
            if retry_options:
                dropped_options = True
                body.pop("stream_options", None)
                continue
            if wait is not None:
                sleep(wait)
                continue
            record["text"] = text
            return record
    finally:
        if owned:
            book.close()


def list_models(*, ledger, base_url, api_key, timeout=DEFAULT_TIMEOUT):
    """GET {base_url}/models; append one models_list event; return its record (model_ids sorted)."""
    request_base, recorded_base, host, port = split_base_url(base_url)
    record = {"base_url": recorded_base, "server_address": host, "server_port": port, "http_status": None,
              "model_ids": None, "count": None, "latency_ms": None, "request_id": None, "ratelimit": {},
              "error_type": None, "error_message": None}
    started = time.perf_counter()
    try:
        response = _open(_endpoint(request_base, "/models"), api_key=api_key, timeout=timeout)
        with response:
            record["http_status"] = response.status
            _record_headers(record, response.headers)
            data = _read_json(response)
        items = data.get("data")
        if not isinstance(items, list):
            raise _CallFailed("invalid_json", "HTTP 200 but the body has no data list", 200)
        ids = sorted({item["id"] for item in items if isinstance(item, dict) and isinstance(item.get("id"), str)})
        record["model_ids"], record["count"] = ids, len(ids)
    except _CallFailed as exc:
        _record_failure(record, exc, [api_key])
    record["latency_ms"] = _ms_since(started)
    book, owned = _open_ledger(ledger, api_key)
    try:
        book.append("models_list", record)
    finally:
        if owned:
            book.close()
    return record


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
    p = argparse.ArgumentParser(prog="ask.py", description="One OpenAI-compatible call, one ledger line "
                                                           "per attempt.")
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
    p.add_argument("--retries", type=int, default=0, help="retries on 408/409/429/5xx/timeouts (default 0)")
    p.add_argument("--backoff", type=float, default=1.0, help="first retry wait in seconds, doubled each time")
    p.add_argument("--max-wait", type=float, default=60.0, help="cap on any one wait, Retry-After included")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds for connect and each read")
    p.add_argument("--expect", metavar="REGEX", help="the answer must match this regex (else exit 3)")
    p.add_argument("--expect-json", action="store_true", help="the answer must be JSON (else exit 3)")
    p.add_argument("--strict-model", action="store_true",
                   help="the served model must equal the requested one (else exit 3)")
    p.add_argument("--store-text", action="store_true", help="keep prompt and answer as artifacts")
    p.add_argument("--json", action="store_true", help="print the whole record instead of the text")
    return p


def _write_out(text):
    """Write to stdout now. A reader that went away (`| head`) stops the printing, not the call:
    the answer is still read to the end and recorded."""
    if _stdout_closed:
        return
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_closed.append(True)
        devnull = os.open(os.devnull, os.O_WRONLY)  # so the interpreter's final flush does not fail
        os.dup2(devnull, sys.stdout.fileno())


_stdout_closed = []


def _err(message, secrets=()):
    print("error: " + reasoning_ledger.redact_text(message, reasoning_ledger.secret_values(secrets)),
          file=sys.stderr)


def main(argv=None):
    args, code = reasoning_ledger.parse_cli(_build_parser(), argv)
    if args is None:
        return code
    secrets = []
    try:
        base_url, model, api_key = settings_from_env(args.base_url, args.model)
        secrets.append(api_key)
        for name, value in (("--retries", args.retries), ("--timeout", args.timeout),
                            ("--max-wait", args.max_wait), ("--backoff", args.backoff)):
            if value < 0 or (name == "--timeout" and value == 0):
                raise ConfigError(f"{name} must be positive")
        ledger_path = args.ledger or os.environ.get("LEDGER") or DEFAULT_LEDGER
        if args.models:
            record = list_models(ledger=ledger_path, base_url=base_url, api_key=api_key, timeout=args.timeout)
            if record["error_type"]:
                _err(f"{record['error_type']}: {record['error_message']} ({record['base_url']})", secrets)
                return EXIT_FAILED
            print(json.dumps(record, ensure_ascii=False) if args.json else "\n".join(record["model_ids"]))
            return EXIT_OK
        if not model:
            raise ConfigError("MODEL_ID is not set (export MODEL_ID=..., or pass --model); there is no default")
        prompt = _read_prompt(args.prompt_file)
        on_text = _write_out if args.stream and not args.json else None
        record = ask(prompt, ledger=ledger_path, base_url=base_url, model=model, api_key=api_key,
                     system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                     stream=args.stream, retries=args.retries, timeout=args.timeout, expect=args.expect,
                     expect_json=args.expect_json, strict_model=args.strict_model, store_text=args.store_text,
                     backoff=args.backoff, max_wait=args.max_wait, on_text=on_text)
    except ConfigError as exc:
        _err(str(exc), secrets)
        return EXIT_USAGE
    except (reasoning_ledger.LedgerError, OSError) as exc:
        _err(reasoning_ledger.error_text(exc), secrets)
        return EXIT_USAGE
    if args.json:
        _write_out(json.dumps(record, ensure_ascii=False) + "\n")
    elif record["text"] and not record["error_type"]:
        ending = "" if record["text"].endswith("\n") else "\n"
        _write_out(ending if args.stream else record["text"] + ending)
    if record["response_model"] and record["response_model"] != model:
        print(f"warning: asked for {model!r}, the server says it ran {record['response_model']!r}",
              file=sys.stderr)
    if record["error_type"]:
        _err(f"{record['error_type']}: {record['error_message']} ({record['base_url']}, attempt "
             f"{record['attempt']})", secrets)
        return EXIT_FAILED
    if record["usage_status"] != "complete" and not args.json:
        print(f"warning: usage {record['usage_status']}: token counts are not fully reported; "
              f"estimates ({EST_METHOD}) are recorded separately", file=sys.stderr)
    if record["check"] is False:
        _err(f"check failed: {record['check_detail']}", secrets)
        return EXIT_CHECK
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
