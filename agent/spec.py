"""``--model SPEC``: which model to drive, and its API key from the environment.

SPEC forms (the part before the first ``:`` names the API):

- ``openai:MODEL`` — OpenAI's Chat Completions (``https://api.openai.com/v1``);
  key ``EGRESSD_OPENAI_API_KEY``, else ``OPENAI_API_KEY``.
- ``anthropic:MODEL`` — Anthropic's Messages API (``https://api.anthropic.com``);
  key ``EGRESSD_ANTHROPIC_API_KEY``, else ``ANTHROPIC_API_KEY``.
- ``openai-compatible:URL:MODEL`` — any Chat Completions server; URL is its
  base including the path (``http://127.0.0.1:11434/v1``) and the model name
  is everything after the first ``:`` that follows the path, so names with
  colons work (``...:11434/v1:llama3.1:8b``). Key ``EGRESSD_MODEL_API_KEY``
  (optional, and never ``OPENAI_API_KEY``: that key is not sent to another
  server).
- ``script:FILE`` — replay FILE (see ``egressd.agent.script``).

``--model-url`` points ``openai:``/``anthropic:`` at another base URL (a
gateway, or a test server). ``open_model`` builds the client.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .anthropic_messages import ANTHROPIC_URL, AnthropicMessagesModel
from .endpoint import Endpoint, RetryPolicy
from .model import Model
from .openai_chat import OPENAI_URL, OpenAIChatModel
from .script import ScriptModel, load_script


class SpecError(ValueError):
    """A --model SPEC, --model-url or API key setting that cannot work."""


class Api(enum.Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OPENAI_COMPATIBLE = "openai-compatible"
    SCRIPT = "script"


@dataclass(frozen=True)
class ModelSpec:
    api: Api
    model: str  # the model name; for script: the file
    base_url: str | None = None


# Where each API's key is read, first match wins.
KEY_VARIABLES: dict[Api, tuple[str, ...]] = {
    Api.OPENAI: ("EGRESSD_OPENAI_API_KEY", "OPENAI_API_KEY"),
    Api.ANTHROPIC: ("EGRESSD_ANTHROPIC_API_KEY", "ANTHROPIC_API_KEY"),
    Api.OPENAI_COMPATIBLE: ("EGRESSD_MODEL_API_KEY",),
    Api.SCRIPT: (),
}
_FORMS = "openai:MODEL, anthropic:MODEL, openai-compatible:URL:MODEL or script:FILE"


def check_url(url: str) -> str:
    """An http(s) base URL with a host (pure); SpecError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecError(f"{url!r} is not an http:// or https:// URL")
    if parts.query or parts.fragment:
        raise SpecError(f"{url!r}: a base URL has no query or fragment")
    return url.rstrip("/")


def parse_model_spec(text: str, model_url: str | None = None) -> ModelSpec:
    """Parse ``--model SPEC`` (and ``--model-url``) into a ModelSpec (pure)."""
    prefix, sep, rest = text.partition(":")
    try:
        api = Api(prefix)
    except ValueError:
        raise SpecError(f"unknown model API {prefix!r} in {text!r}; use {_FORMS}") from None
    if not sep or not rest:
        raise SpecError(f"{text!r} names no {'file' if api is Api.SCRIPT else 'model'}; use {_FORMS}")
    if model_url is not None and api not in (Api.OPENAI, Api.ANTHROPIC):
        raise SpecError(f"--model-url applies to openai: and anthropic: only (for {api.value}: the SPEC says where)")
    if api is Api.SCRIPT:
        return ModelSpec(api, rest)
    if api is Api.OPENAI_COMPATIBLE:
        scheme, slashes, after = rest.partition("://")
        path_start = after.find("/")
        if not slashes or path_start < 0:
            raise SpecError(
                f"{text!r}: expected openai-compatible:URL:MODEL with a path in the URL, e.g. openai-compatible:http://127.0.0.1:11434/v1:llama3.1:8b"
            )
        colon = after.find(":", path_start)
        if colon < 0 or colon == len(after) - 1:
            raise SpecError(f"{text!r}: name the model after the URL: openai-compatible:URL:MODEL")
        return ModelSpec(api, after[colon + 1 :], check_url(f"{scheme}://{after[:colon]}"))
    default = OPENAI_URL if api is Api.OPENAI else ANTHROPIC_URL
    return ModelSpec(api, rest, check_url(model_url) if model_url is not None else default)


def api_key(api: Api, environ: Mapping[str, str]) -> str | None:
    """The API key for ``api`` from the environment (pure); SpecError when a required one is missing."""
    for name in KEY_VARIABLES[api]:
        if environ.get(name):
            return environ[name]
    if api in (Api.OPENAI, Api.ANTHROPIC):
        names = " or ".join(KEY_VARIABLES[api][::-1])
        raise SpecError(f"no API key for {api.value}: set {names}")
    return None


def open_model(
    spec: ModelSpec,
    *,
    environ: Mapping[str, str],
    policy: RetryPolicy | None = None,
    notify: Callable[[str], None] | None = None,
) -> tuple[Model, str | None]:
    """Build the client for ``spec``; returns it and the API key it uses (to keep out of everything else)."""
    if spec.api is Api.SCRIPT:
        return ScriptModel(load_script(Path(spec.model)), name=f"script {spec.model}"), None
    key = api_key(spec.api, environ)
    assert spec.base_url is not None
    hint = " or ".join(KEY_VARIABLES[spec.api][::-1]) or "the key"
    endpoint = Endpoint(
        provider=spec.api.value,
        model=spec.model,
        key_hint=hint,
        policy=policy or RetryPolicy(),
        secrets=[key] if key else [],
        notify=notify,
    )
    if spec.api is Api.ANTHROPIC:
        assert key is not None
        return AnthropicMessagesModel(endpoint=endpoint, base_url=spec.base_url, model=spec.model, api_key=key), key
    return OpenAIChatModel(endpoint=endpoint, base_url=spec.base_url, model=spec.model, api_key=key), key
