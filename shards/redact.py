"""Credential redaction for every URL that reaches a log line, an error, a record or a repr.

Lives in `shards/` (no torch, no ray) so that shard readers, the build and the loader
all redact the same way: one function, applied before a URL leaves the code that holds it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# A parameter is a secret by its name: any name holding one of these (case-insensitive,
# after percent-decoding) has its value redacted, so that the next store's spelling
# (`X-Goog-Signature`, `private_key`, `sessionid`, `pwd`) needs no new entry. A few short
# names that are secrets but hold none of the parts are listed whole.
_SECRET_NAME = re.compile(
    r"key|token|secret|sig|pass|pwd|credential|auth|session|cookie|bearer|jwt|private",
    re.IGNORECASE,
)
_SECRET_NAMES = frozenset({"code", "sas", "sid", "otp", "pin", "nonce"})
# `name=value` in a query or fragment: `&` and `;` both separate parameters, and a
# fragment may hold a route before its own `?` (`#/cb?access_token=...`). A value ends
# at a `?` too, so a URL pasted unencoded into another's value (`next=https://x/?token=`)
# has its own parameters checked.
_PARAM = re.compile(r"(?P<name>[^&;?#=]+)=(?P<value>[^&;?#]*)")
# `;name=value` path parameters (`/a;jsessionid=...`): only after a `;`, so a
# partition folder such as `/key=abc/` stays as written.
_PATH_PARAM = re.compile(r";(?P<name>[^/;?#=]+)=(?P<value>[^/;?#]*)")


def redact_url(url: str) -> str:
    """Return `url` with credentials removed, for logs, errors, records and sample metadata.

    `user:password@` becomes `***@`. In the query, the fragment and `;` path
    parameters, the value of every parameter whose name looks like a secret becomes
    `REDACTED`: a name holding key, token, secret, sig (signature, sign), pass or
    pwd, credential, auth, session, cookie, bearer, jwt or private, or one of
    `code`, `sas`, `sid`, `otp`, `pin`, `nonce`; `&` and `;` both separate
    parameters. Local paths are returned unchanged. Never raises, since it is called
    while reporting other errors.
    """
    if not isinstance(url, str):
        return repr(url)
    if not _SCHEME.match(url):
        return url
    url = _redact_userinfo(url)
    cut = min((i for i in (url.find("?"), url.find("#")) if i >= 0), default=len(url))
    head, tail = url[:cut], url[cut:]
    authority = head.find("/", head.find("://") + 3) if "://" in head else head.find(":") + 1
    if authority >= 0:
        head = head[:authority] + _PATH_PARAM.sub(_redact_path_param, head[authority:])
    return head + _PARAM.sub(_redact_param, tail)


def is_secret_name(name: str) -> bool:
    """Whether a URL parameter (or option) called `name` carries a credential."""
    lowered = unquote(name).strip().lower()
    return lowered in _SECRET_NAMES or _SECRET_NAME.search(lowered) is not None


def _redact_userinfo(url: str) -> str:
    start = url.find("://")
    if start < 0:
        return url
    start += 3
    end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
    # The last '@' of the authority ends the userinfo, as in urlsplit: a password may hold '@'.
    at = url.rfind("@", start, end)
    return url if at < 0 else f"{url[:start]}***{url[at:]}"


CREDENTIALS_HINT = (
    "put no credentials in the URL: pass them as storage_options (LoaderConfig("
    "storage_options={'key': ..., 'secret': ...}) for s3) or use the store's own credential "
    "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, an instance role; "
    "GOOGLE_APPLICATION_CREDENTIALS for gs)"
)


def url_credentials_problem(url: str, shape: str = "none") -> str | None:
    """Why an object-store URL must be refused for the credentials it holds, or None.

    `s3://KEY:SECRET@bucket/x` reaches s3fs as a bucket named `KEY:SECRET@bucket`, which
    it logs at DEBUG: a secret in a URL leaks wherever the URL goes. What is refused
    depends on the store's credential `shape` (its `Transport.credentials`; ask
    `shards.storage.urls.credentials_problem`, which looks it up): `none`, any
    `userinfo@` (a bucket name never holds `@`); `account`, URLs naming
    `container@account` (Azure), only a `user:password@`; `basic` (http(s)), nothing,
    as `user:password@` is Basic auth. The message shows the URL redacted, never the secret.
    """
    match = _SCHEME.match(url) if isinstance(url, str) else None
    if match is None or shape == "basic":
        return None
    start = url.find("://")
    if start < 0:
        return None
    start += 3
    end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
    at = url.rfind("@", start, end)
    if at < 0 or (shape == "account" and ":" not in url[start:at]):
        return None
    return f"{redact_url(url)!r} holds credentials before its bucket (user:secret@); " + (
        CREDENTIALS_HINT
    )


def _redact_param(match: re.Match) -> str:
    name = match.group("name")
    return f"{name}=REDACTED" if is_secret_name(name) else match.group(0)


def _redact_path_param(match: re.Match) -> str:
    return (
        f";{match.group('name')}=REDACTED"
        if is_secret_name(match.group("name"))
        else match.group(0)
    )


def redact_text(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """`text` with each of `secrets` masked and every URL in it redacted."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return _URL_IN_TEXT.sub(_redact_match, text)


def _redact_match(match: re.Match) -> str:
    return redact_url(match.group(0))
