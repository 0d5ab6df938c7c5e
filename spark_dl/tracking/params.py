"""Turning arbitrary values into what MLflow accepts: flat string params and valid metric names."""
from __future__ import annotations

import functools
import re
from typing import Any, Mapping

MAX_PARAM_VALUE = 6000
MAX_KEY = 250
_BAD_NAME_CHARS = re.compile(r"[^\w\-. /:]")
_PLAIN = (str, int, float, bool, type(None))


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": {"c": 1}}}`` -> ``{"a.b.c": 1}``."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def is_plain(value: Any) -> bool:
    """Values worth recording as a parameter: scalars, and lists/tuples/dicts of them."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= 64 and all(isinstance(v, _PLAIN) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def param_value(value: Any) -> str:
    """``value`` as MLflow shows a param, at most ``MAX_PARAM_VALUE`` characters (MLflow refuses
    longer ones): a longer one is cut and marked, ending ``...[cut from N chars]`` (see
    :func:`cut_from`). A value already made by this function comes back unchanged."""
    text = value if isinstance(value, str) else repr(value) if isinstance(value, (list, tuple)) else str(value)
    if len(text) <= MAX_PARAM_VALUE:
        return text
    mark = _CUT_MARK.format(len(text))
    return text[: MAX_PARAM_VALUE - len(mark)] + mark


_CUT_MARK = "...[cut from {} chars]"
_CUT = re.compile(r"\.\.\.\[cut from (\d+) chars\]\Z")


def cut_from(text: str) -> int | None:
    """The length of the value :func:`param_value` cut to ``text`` (on the rank or on the driver),
    or None when ``text`` is whole."""
    if not isinstance(text, str) or len(text) != MAX_PARAM_VALUE:
        return None
    m = _CUT.search(text)
    return int(m.group(1)) if m is not None and int(m.group(1)) > MAX_PARAM_VALUE else None


def cut_warning(key: str, length: int) -> str:
    """What the driver says, once per key, of a param that was cut."""
    return (f"param {key!r} is {length} characters, more than MLflow's limit of {MAX_PARAM_VALUE}: it was "
            f"logged cut, ending '{_CUT_MARK.format(length)}'. Log long text as an artifact instead, e.g. "
            f"spark_dl.tracking.log_artifact_bytes(text.encode(), '{key}.txt') or mlflow.log_text(text, "
            f"'{key}.txt') on rank 0, and keep the param short")


@functools.lru_cache(maxsize=4096)
def clean_name(name: str) -> str:
    """An MLflow-valid metric/param key: unsupported characters become ``_``."""
    return _BAD_NAME_CHARS.sub("_", str(name))[:MAX_KEY] or "_"


REDACTED = "***"
# a name's words (split at _ - . and camelCase) that mark its value as a credential; "key" only
# after a word that says which (api_key, access_key, ...), so "sort_key" and "max_tokens" stay
_SECRET_WORDS = frozenset({"password", "passwd", "pwd", "secret", "token", "credential", "credentials", "apikey",
                           "auth", "authorization", "passphrase", "sas", "dsn"})
_KEY_KINDS = frozenset({"api", "access", "private", "secret", "account", "signing", "encryption", "ssh"})
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def is_secret_name(name: str) -> bool:
    """Whether an argument called ``name`` (``hf_token``, ``--db-password``, ``apiKey``) holds a credential."""
    words = [w.lower() for w in _WORDS.findall(str(name))]
    return any(w in _SECRET_WORDS or (w == "key" and i > 0 and words[i - 1] in _KEY_KINDS)
               for i, w in enumerate(words))


def redact_argv(argv: list[str]) -> list[str]:
    """A script's command line with the values of credential options (``--token X``,
    ``--db-password=X``) as ``***``: an option's value is the next word unless that starts with ``-``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if arg.startswith("-") and len(arg) > 1:
            flag, eq, _ = arg.partition("=")
            if is_secret_name(flag):
                if eq:
                    arg = f"{flag}={REDACTED}"
                else:
                    hide_next = True
        out.append(arg)
    return out


_URL_PASSWORD = re.compile(r"(\w[\w+.-]*://[^/:@\s]*:)[^/\s]+(@)")  # to the last @ of the authority


def _no_url_password(value: Any) -> Any:
    return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}\g<2>", value) if isinstance(value, str) else value


def redact(params: Mapping[str, Any]) -> dict[str, Any]:
    """The run's arguments as tracking logs them: a credential's value (by its name, see
    :func:`is_secret_name`) as ``***``, a script's ``argv`` through :func:`redact_argv`, and the
    password of a URL (``postgresql://user:pw@host``) as ``***``."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is not None and value != "" and is_secret_name(key.rsplit(".", 1)[-1]):
            value = REDACTED
        elif key == "argv" and isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
            value = [_no_url_password(a) for a in redact_argv(list(value))]
        elif isinstance(value, (list, tuple)):
            value = type(value)(_no_url_password(v) for v in value)
        out[key] = _no_url_password(value)
    return out
