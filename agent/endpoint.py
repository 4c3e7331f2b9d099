"""POST JSON to a model endpoint: a request timeout, retries with backoff, clear errors.

Both model APIs share this shell. What it guarantees:

- The model's own traffic goes straight to the endpoint: ``trust_env=False``,
  so HTTP(S)_PROXY and ~/.netrc of egressd's environment are never used
  (the model is egressd's own client, not the sandbox's).
- No redirect is followed: the API key (``x-api-key``, ``Authorization``)
  goes to the configured URL and nowhere else (DESIGN.md, "Secrets"); a 3xx
  answer is an error naming where it pointed, for the user to check and
  configure if they mean it.
- Each attempt is bounded by ``timeout_s``. 408, 409, 429 and 5xx (529
  included) answers, connection errors and timeouts are retried up to
  ``attempts`` tries in all, waiting what ``retry-after-ms`` / ``retry-after``
  say, else an exponential backoff with jitter; a 429 that means "out of
  money" (OpenAI ``insufficient_quota``, Anthropic
  ``enforced_spend_limit_reached``) is not, since waiting does not help.
- 401/403 say the key was refused, 404 names the model and the URL, every
  other answer quotes the endpoint's own message. Every message has the API
  key cut out (some endpoints echo part of it back).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from egressd.names.shown import logged

from .model import ModelError

# Error codes for which waiting does not help, though the status is 429.
_NOT_RETRYABLE_CODES = frozenset({"insufficient_quota", "enforced_spend_limit_reached"})
_RETRYABLE_STATUSES = frozenset({408, 409, 429})
# A quoted endpoint message longer than this is cut: it is for a person to read.
_MAX_MESSAGE_CHARS = 400
USER_AGENT = "egressd-agent"


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # in all: the first try and four retries
    base_delay_s: float = 1.0  # doubles after each failure: 1, 2, 4, 8 s (with jitter)
    max_delay_s: float = 60.0  # also caps what a retry-after header may ask for
    timeout_s: float = 120.0  # one request; a long completion can take a minute


def retry_after_s(headers: Any, now: float) -> float | None:
    """Seconds a response asks us to wait (``retry-after-ms``, ``retry-after`` seconds or date); pure."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


def error_fields(body: Any) -> tuple[str | None, str | None]:
    """(message, code) of an OpenAI- or Anthropic-style error body; pure.

    OpenAI: ``{"error": {"message", "type", "code"}}``; Anthropic: ``{"type":
    "error", "error": {"type", "message", "details": {"error_code"}}}``; some
    compatible servers send ``{"error": "text"}`` or ``{"detail": ...}``.
    """
    if not isinstance(body, dict):
        return None, None
    error = body.get("error")
    if isinstance(error, str):
        return error, None
    if isinstance(error, dict):
        found = error.get("details")
        details = found if isinstance(found, dict) else {}
        code = details.get("error_code") or error.get("code") or error.get("type")
        message = error.get("message")
        return (str(message) if message is not None else None), (str(code) if code is not None else None)
    detail = body.get("detail") or body.get("message")
    return (str(detail) if detail is not None else None), None


class Endpoint:
    """One model API's HTTP endpoint, with its headers, retry policy and secrets to hide."""

    def __init__(
        self,
        *,
        provider: str,
        model: str,
        key_hint: str,
        policy: RetryPolicy = RetryPolicy(),
        secrets: Sequence[str] = (),
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.provider = provider
        self.model = model
        self.key_hint = key_hint
        self.policy = policy
        self._secrets = [s for s in secrets if s]
        self._notify = notify
        self._session: aiohttp.ClientSession | None = None

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=self.policy.timeout_s),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """POST ``body`` and return the JSON object answered; ModelError when no attempt succeeds."""
        policy = self.policy
        for attempt in range(1, policy.attempts + 1):
            wait: float | None = None
            try:
                async with self._session_now().post(url, json=body, headers=headers, allow_redirects=False) as response:
                    if 300 <= response.status < 400:
                        raise self._redirected(url, response.status, response.headers.get("Location"))
                    text = await response.text(errors="replace")
                    if response.status == 200:
                        return self._parse_ok(url, text)
                    failure, retryable = self._failure(url, response.status, text)
                    if not retryable:
                        raise failure
                    wait = retry_after_s(response.headers, time.time())
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                reason = (
                    "no answer within the request timeout"
                    if isinstance(exc, TimeoutError)
                    else str(exc) or type(exc).__name__
                )
                failure = ModelError(self.redact(f"{self.provider}: cannot reach {url}: {reason}"))
            except aiohttp.ClientError as exc:
                raise ModelError(self.redact(f"{self.provider}: request to {url} failed: {exc}")) from None
            if attempt == policy.attempts:
                raise ModelError(f"{failure} (gave up after {policy.attempts} attempts)")
            delay = wait if wait is not None else policy.base_delay_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)
            delay = min(delay, policy.max_delay_s)
            if self._notify is not None:
                self._notify(f"{failure}; retrying in {delay:.1f} s (attempt {attempt + 1}/{policy.attempts})")
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _parse_ok(self, url: str, text: str) -> dict[str, Any]:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise ModelError(
                self.redact(f"{self.provider}: {url} answered 200 with something that is not JSON: {text[:200]!r}")
            ) from None
        if not isinstance(data, dict):
            raise ModelError(f"{self.provider}: {url} answered 200 with JSON that is not an object")
        return data

    def _redirected(self, url: str, status: int, location: str | None) -> ModelError:
        where = self.redact(location or "(no Location)")
        where = logged(where, _MAX_MESSAGE_CHARS)
        return ModelError(
            f"{self.provider}: {url} answered a redirect (HTTP {status} to {where}); redirects are not followed, "
            "so the API key goes nowhere else: if that is the right endpoint, give its URL"
        )

    def _failure(self, url: str, status: int, text: str) -> tuple[ModelError, bool]:
        """The error for a non-200 answer, and whether retrying can help."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = None
        message, code = error_fields(body)
        if message is None:
            message = text.strip() or "(no body)"
        message = self.redact(message)
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[:_MAX_MESSAGE_CHARS] + "…"
        quoted = f"HTTP {status}: {message}"
        retryable = (status in _RETRYABLE_STATUSES or status >= 500) and code not in _NOT_RETRYABLE_CODES
        if status in (401, 403):
            error = ModelError(f"{self.provider} refused the API key ({quoted}); check {self.key_hint}")
        elif status == 404:
            error = ModelError(
                f"{self.provider}: model {self.model!r} not found at {url} ({quoted}); "
                "check the model name in --model and the endpoint URL"
            )
        elif status == 429 and not retryable:
            error = ModelError(f"{self.provider}: out of quota ({quoted})")
        else:
            error = ModelError(f"{self.provider}: {url} answered {quoted}")
        return error, retryable
