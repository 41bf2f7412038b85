"""Credential redaction for every URL that reaches a log line, an error, a record or a repr.

Lives in `shards/` (no torch, no ray) so that shard readers, the build and the loader
all redact the same way: one function, applied before a URL leaves the code that holds it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# Query parameter names whose values are secrets (matched case-insensitively).
_SECRET_PARAMS = frozenset(
    {"sig", "signature", "key", "apikey", "api_key", "auth", "authorization", "code", "sas"}
)
_SECRET_PARAM_PARTS = ("token", "signature", "secret", "password", "credential", "api-key")


def redact_url(url: str) -> str:
    """Return `url` with credentials removed, for logs, errors and sample metadata.

    `user:password@` becomes `***@`, and the values of secret query parameters
    (`X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`, `token`,
    `sig`, ...) become `REDACTED`. Local paths are returned unchanged. Never
    raises, since it is called while reporting other errors.
    """
    if not isinstance(url, str):
        return repr(url)
    if not _SCHEME.match(url):
        return url
    url = _redact_userinfo(url)
    head, sep, rest = url.partition("?")
    if not sep:
        return url
    query, hash_sep, fragment = rest.partition("#")
    params = [_redact_param(param) for param in query.split("&")]
    return f"{head}?{'&'.join(params)}{hash_sep}{fragment}"


def _redact_userinfo(url: str) -> str:
    start = url.find("://")
    if start < 0:
        return url
    start += 3
    end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
    # The last '@' of the authority ends the userinfo, as in urlsplit: a password may hold '@'.
    at = url.rfind("@", start, end)
    return url if at < 0 else f"{url[:start]}***{url[at:]}"


# Schemes whose authority may carry `user:password@` by design: HTTP Basic auth, which the
# loader sends only to the URL's own origin and redacts everywhere else.
USERINFO_SCHEMES = frozenset({"http", "https"})
# Stores whose authority is `container@account` (adlfs): an `@` alone is no credential there.
_ACCOUNT_SCHEMES = frozenset({"az", "abfs", "abfss", "adl"})
CREDENTIALS_HINT = (
    "put no credentials in the URL: pass them as storage_options (LoaderConfig("
    "storage_options={'key': ..., 'secret': ...}) for s3) or use the store's own credential "
    "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, an instance role; "
    "GOOGLE_APPLICATION_CREDENTIALS for gs)"
)


def url_credentials_problem(url: str) -> str | None:
    """Why an object-store URL must be refused for the credentials it holds, or None.

    `s3://KEY:SECRET@bucket/x` reaches s3fs as a bucket named `KEY:SECRET@bucket`, which
    it logs at DEBUG: a secret in a URL leaks wherever the URL goes. Any `userinfo@` in
    an object-store URL is refused (a bucket name never holds `@`); Azure URLs name
    `container@account`, so there only a `user:password@` is. http(s) may carry Basic
    auth (`USERINFO_SCHEMES`). The message shows the URL redacted, never the secret.
    """
    match = _SCHEME.match(url) if isinstance(url, str) else None
    if match is None or match.group(1).lower() in USERINFO_SCHEMES:
        return None
    start = url.find("://")
    if start < 0:
        return None
    start += 3
    end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
    at = url.rfind("@", start, end)
    if at < 0 or (match.group(1).lower() in _ACCOUNT_SCHEMES and ":" not in url[start:at]):
        return None
    return f"{redact_url(url)!r} holds credentials before its bucket (user:secret@); " + (
        CREDENTIALS_HINT
    )


def _redact_param(param: str) -> str:
    name, sep, _value = param.partition("=")
    lowered = unquote(name).lower()
    secret = lowered in _SECRET_PARAMS or any(part in lowered for part in _SECRET_PARAM_PARTS)
    return f"{name}{sep}REDACTED" if secret and sep else param


def redact_text(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """`text` with each of `secrets` masked and every URL in it redacted."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return _URL_IN_TEXT.sub(_redact_match, text)


def _redact_match(match: re.Match) -> str:
    return redact_url(match.group(0))
