"""The dashboard's request-level protection (dashboard/web/security.py, docs/security.md): the
--host/--token/--run checks, the Host check against DNS rebinding, the Origin check, the token
and its cookie, and 404s for bogus component paths. Against the Flask test client and against a
real ``python app.py`` server. The Chromium half is in tests/browser/test_browser_security_scale.py.

These tests need no store contents: a run directory nothing has written to yet serves the whole
app (waiting for its first sample)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from browser_helpers import Server

from bench import synth_store
from dashboard.read.store import Store
from dashboard.web import ids
from dashboard.web.config import ServedAt
from dashboard.web.security import (
    check_host,
    check_token,
    generate_token,
    is_loopback,
    same_origin,
    split_host_header,
)
from dashboard.web.server import AppConfig, create_app

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-0123456789abcdefghij"          # 24 url-safe characters
SECURITY_LOG = "modscope.security"
SERVED = (200, 204)     # Dash ran the callback (204: nothing to update, e.g. no store written yet)


def run_app(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, str(REPO / "app.py"), *args], capture_output=True, text=True,
                          timeout=60, cwd=str(REPO), env=dict(os.environ, **(env or {})), check=False)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("modscope: error: "), lines[0]
    assert "modscope dashboard:" not in r.stdout        # nothing was served
    return lines[0]


def make_app(tmp_path: Path, bind_host: str = "127.0.0.1", bind_port: int | None = None, token: str | None = None):
    store = Store.open_run(tmp_path / "run")
    return create_app(AppConfig(mode="live", store=store, served=ServedAt(bind_host, bind_port, token)))


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == SECURITY_LOG]


def snapshot_callback_body(client, headers: dict | None = None) -> dict:
    """The request the page sends when "Snapshot" is clicked (what a rebinding page would send)."""
    deps = client.get("/_dash-dependencies", headers=headers or {}).get_json()
    dep = next(d for d in deps if any(i["id"] == ids.EXPORT_SNAPSHOT_BTN for i in d["inputs"]))
    outputs = [dict(zip(("id", "property"), o.split(".", 1), strict=True))
               for o in dep["output"].strip(".").split("...")]
    return {"output": dep["output"], "outputs": outputs,
            "inputs": [{"id": ids.EXPORT_SNAPSHOT_BTN, "property": "n_clicks", "value": 1}],
            "changedPropIds": [f"{ids.EXPORT_SNAPSHOT_BTN}.n_clicks"],
            "state": [{**s, "value": None} for s in dep["state"]]}


# -- --host -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"), ("::1", "::1"), ("[::1]", "::1"), ("::", "::"),
    ("0:0:0:0:0:0:0:1", "::1"), ("localhost", "localhost"), ("LocalHost", "localhost"),
    ("myhost.example.com.", "myhost.example.com"), ("gpu-box-3", "gpu-box-3"), (" 10.0.0.7 ", "10.0.0.7"),
])
def test_check_host_normalises(value, expected):
    assert check_host(value) == expected


@pytest.mark.parametrize("value, problem", [
    ("", "empty"), ("   ", "empty"), ("not a host!", "not an IP address or a host name"),
    ("999.1.1.1", "not an IPv4 address"), ("10.1", "not an IPv4 address"), ("1.2.3.4.5", "not an IPv4 address"),
    ("[::1", "not an IP address"), ("a..b", "not an IP address"), ("-lead.example", "not an IP address"),
    ("under_score", "not an IP address"), ("x" * 64, "not an IP address"), ("host.123", "not an IP address"),
    ("127.0.0.1:8050", "not an IP address"), ("http://127.0.0.1", "not an IP address"),
])
def test_check_host_refuses_with_one_line(value, problem):
    with pytest.raises(ValueError) as exc:
        check_host(value)
    msg = str(exc.value)
    assert msg.startswith(f"--host {value!r}: {problem}") and "\n" not in msg
    assert "expected" in msg or "such as" in msg


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("", False), ("myhost", False),
    ("localhost.evil.example", False), ("127.0.0.1.nip.io", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_bad_host_on_the_command_line_exits_2(tmp_path):
    for value, problem in [("", "empty"), ("not a host!", "not an IP address or a host name"),
                           ("999.1.1.1", "not an IPv4 address")]:
        # HOST in the environment must not stand in for an empty --host (Dash would read it)
        line = one_error_line(run_app("--run", str(tmp_path / "run"), "--host", value, "--port", "1",
                                      env={"HOST": "0.0.0.0"}))
        assert line.startswith(f"modscope: error: --host {value!r}: {problem}"), line


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port`` (Linux /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:          # 0A: LISTEN
                found.add(addr)
    return found


def test_host_in_the_environment_does_not_change_the_bind(tmp_path):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the listening sockets from /proc/net/tcp (Linux)")
    srv = Server(["--run", str(tmp_path / "run")], env={"HOST": "0.0.0.0"})
    try:
        assert listening_addresses(srv.port) == {"0100007F"}          # 127.0.0.1 only
        assert "?token=" not in srv.output()
    finally:
        srv.stop()


# -- --token ------------------------------------------------------------------------------------
def test_generated_tokens_are_long_and_url_safe():
    tokens = {generate_token() for _ in range(20)}
    assert len(tokens) == 20
    assert all(len(t) >= 32 and re.fullmatch(r"[A-Za-z0-9_-]+", t) for t in tokens)
    assert check_token(TOKEN) == TOKEN


@pytest.mark.parametrize("token, problem", [("s3cret", "6 characters, too short"),
                                            ("x" * 15, "15 characters, too short"),
                                            ("has space 0123456789", "characters other than")])
def test_check_token_refuses_without_echoing_the_token(token, problem):
    with pytest.raises(ValueError) as exc:
        check_token(token)
    assert problem in str(exc.value) and token not in str(exc.value)


def test_short_token_on_the_command_line_exits_2(tmp_path):
    line = one_error_line(run_app("--run", str(tmp_path / "run"), "--token", "short-token", "--port", "1"))
    assert "--token: 11 characters, too short; expected at least 16" in line
    # also before the demo would start: no run directory is made
    line = one_error_line(run_app("--token", "short", "--runs-dir", str(tmp_path / "runs"), "--port", "1"))
    assert "too short" in line and not (tmp_path / "runs").exists()


def test_create_app_refuses_a_short_token(tmp_path):
    with pytest.raises(ValueError, match="too short"):
        make_app(tmp_path, token="T0k")


def test_generated_token_on_a_non_loopback_bind(tmp_path):
    srv = Server(["--run", str(tmp_path / "run")], host="0.0.0.0")
    try:
        m = re.search(r"\?token=([A-Za-z0-9_-]+)", srv.output())
        assert m and len(m.group(1)) >= 32, srv.output()
        assert status(srv.url + "_dash-layout") == 401
        assert status(srv.url + "_dash-layout", {"X-Modscope-Token": m.group(1)}) == 200
    finally:
        srv.stop()


# -- --run --------------------------------------------------------------------------------------
def test_run_that_is_not_a_directory_exits_2(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a store\n")
    empty = tmp_path / "empty.log"
    empty.touch()
    for path, problem in [("/dev/null", "a character device"), (str(text), "a file that is not an SQLite store"),
                          (str(empty), "a file that is not an SQLite store")]:
        line = one_error_line(run_app("--run", path, "--port", "1"))
        assert f"--run {path}: {problem}" in line and "expected a run directory or a store file" in line
    line = one_error_line(run_app("export", "--run", "/dev/null", "-o", str(tmp_path / "r.html")))
    assert "--run /dev/null: a character device" in line
    line = one_error_line(run_app("--snapshot", "/dev/null", "--port", "1"))
    assert "--snapshot /dev/null: a character device; expected a store file" in line


# -- Host and Origin parsing ----------------------------------------------------------------------
@pytest.mark.parametrize("header, parsed", [
    ("127.0.0.1:8050", ("127.0.0.1", 8050)), ("LOCALHOST", ("localhost", None)), ("[::1]:80", ("::1", 80)),
    ("[0:0::1]", ("::1", None)), ("evil.example.com:8050", ("evil.example.com", 8050)),
    ("", None), ("[::1", None), ("::1", None), ("[127.0.0.1]:80", None), ("host:", None), ("host:x", None),
    ("host:70000", None), ("a:1:2", None), ("localhost:\u00b2", None), ("localhost:+80", None),
])
def test_split_host_header(header, parsed):
    assert split_host_header(header) == parsed


@pytest.mark.parametrize("origin, scheme, host, same", [
    ("http://127.0.0.1:8050", "http", "127.0.0.1:8050", True),
    ("http://LOCALHOST:8050", "http", "localhost:8050", True),
    ("http://[::1]:8050", "http", "[::1]:8050", True),
    ("http://example.com", "http", "example.com:80", True),
    ("http://127.0.0.1:8050", "http", "localhost:8050", False),
    ("http://127.0.0.1:9999", "http", "127.0.0.1:8050", False),
    ("https://127.0.0.1:8050", "http", "127.0.0.1:8050", False),
    ("http://evil.example.com:8050", "http", "127.0.0.1:8050", False),
    ("null", "http", "127.0.0.1:8050", False),
    ("http://127.0.0.1:8050/path", "http", "127.0.0.1:8050", False),
    ("http://127.0.0.1:bad", "http", "127.0.0.1:8050", False),
])
def test_same_origin(origin, scheme, host, same):
    assert same_origin(origin, scheme, host) is same


# -- the Host check (DNS rebinding), test client ----------------------------------------------------
def test_loopback_bind_answers_only_to_its_own_names(tmp_path, caplog):
    client = make_app(tmp_path, bind_host="127.0.0.1", bind_port=8050).server.test_client()
    caplog.set_level(logging.INFO, logger=SECURITY_LOG)
    for host in ("127.0.0.1:8050", "localhost:8050", "[::1]:8050", "localhost", "127.0.0.1:9000", "LOCALHOST:1"):
        r = client.get("/_dash-layout", headers={"Host": host})
        assert r.status_code == 200, host
    assert refusals(caplog) == []
    refused = ["evil.example.com:8050", "evil.example.com", "127.0.0.1.nip.io:8050", "localhost.evil.example:8050",
               "127.0.0.2:8050", "0.0.0.0:8050", "", "[::1"]
    for host in refused:
        r = client.get("/_dash-layout", headers={"Host": host})
        assert r.status_code == 403, host
        assert r.mimetype == "text/plain" and r.get_data(as_text=True).count("\n") == 1
        assert r.get_data(as_text=True).startswith("403 Forbidden")
    lines = refusals(caplog)
    assert len(lines) == len(refused)                                  # one line per refused request
    assert all("\n" not in line and "DNS rebinding" in line for line in lines)
    assert "'evil.example.com:8050'" in lines[0]


def test_rebinding_page_cannot_download_the_store(tmp_path):
    """What the issue reproduced: a page on evil.example.com (resolving to 127.0.0.1) asks for the
    snapshot. The same request with the dashboard's own Host gets it; with the rebound Host, 403."""
    synth_store.demo(tmp_path / "run" / "modscope.sqlite", steps=3)
    client = make_app(tmp_path, bind_host="127.0.0.1", bind_port=8050).server.test_client()
    own = {"Host": "127.0.0.1:8050", "Origin": "http://127.0.0.1:8050"}
    body = snapshot_callback_body(client)
    r = client.post("/_dash-update-component", json=body, headers=own)
    assert r.status_code == 200 and '"filename":"' in r.get_data(as_text=True)    # the store, base64
    evil = {"Host": "evil.example.com:8050", "Origin": "http://evil.example.com:8050"}
    for path in ("/", "/_dash-layout", "/_dash-dependencies"):
        assert client.get(path, headers={"Host": evil["Host"]}).status_code == 403
    r = client.post("/_dash-update-component", json=body, headers=evil)
    assert r.status_code == 403 and "filename" not in r.get_data(as_text=True)


def test_bound_address_is_accepted_as_host(tmp_path):
    client = make_app(tmp_path, bind_host="127.0.0.2", bind_port=8050).server.test_client()
    assert client.get("/_dash-layout", headers={"Host": "127.0.0.2:8050"}).status_code == 200
    assert client.get("/_dash-layout", headers={"Host": "127.0.0.3:8050"}).status_code == 403


# -- the Origin check, test client -----------------------------------------------------------------
def test_state_changing_requests_from_a_foreign_origin_are_refused(tmp_path, caplog):
    client = make_app(tmp_path, bind_host="127.0.0.1", bind_port=8050).server.test_client()
    body = snapshot_callback_body(client)
    caplog.set_level(logging.INFO, logger=SECURITY_LOG)
    host = {"Host": "127.0.0.1:8050"}
    for origin in ("http://evil.example.com", "http://127.0.0.1:9999", "https://127.0.0.1:8050",
                   "http://localhost:8050", "null"):
        r = client.post("/_dash-update-component", json=body, headers={**host, "Origin": origin})
        assert r.status_code == 403 and r.get_data(as_text=True) == "403 Forbidden: cross-origin request\n", origin
    assert len(refusals(caplog)) == 5 and all("cross-site" in line for line in refusals(caplog))
    # the page's own POSTs, and scripts that send no Origin at all (urllib, curl)
    assert client.post("/_dash-update-component", json=body,
                       headers={**host, "Origin": "http://127.0.0.1:8050"}).status_code in SERVED
    assert client.post("/_dash-update-component", json=body, headers=host).status_code in SERVED
    # GET carries no Origin check: a cross-origin page cannot read the answer anyway
    assert client.get("/_dash-layout", headers={**host, "Origin": "http://evil.example.com"}).status_code == 200


# -- the token, test client -------------------------------------------------------------------------
def token_client(tmp_path, host="0.0.0.0"):
    return make_app(tmp_path, bind_host=host, bind_port=8050, token=TOKEN).server.test_client()


def test_token_in_the_url_becomes_a_cookie_and_leaves_the_url(tmp_path, caplog):
    client = token_client(tmp_path)
    caplog.set_level(logging.INFO, logger=SECURITY_LOG)
    r = client.get(f"/modules?a=1&token={TOKEN}&b=x+y")
    assert r.status_code == 200 and r.mimetype == "text/html"
    cookie = r.headers["Set-Cookie"]
    assert cookie.startswith(f"modscope_token_8050={TOKEN};")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    page = r.get_data(as_text=True)
    assert 'location.replace("/modules?a=1&b=x+y")' in page and TOKEN not in page
    assert r.headers["Cache-Control"] == "no-store" and r.headers["Referrer-Policy"] == "no-referrer"
    assert client.get("/modules?a=1&b=x+y").status_code == 200           # the cookie from now on
    assert client.get("/_dash-layout").status_code == 200
    assert refusals(caplog) == []


def test_token_redirect_stays_on_the_site(tmp_path):
    client = token_client(tmp_path)
    for path, target in [("//evil.example.com/x", '"/evil.example.com/x"'), ("/", '"/"'),
                         ("/a b", '"/a%20b"'), ("/<script>", '"/%3Cscript%3E"')]:
        # PATH_INFO as the server decodes it (the test client would read //host as a host)
        r = client.get("/", environ_overrides={"PATH_INFO": path, "QUERY_STRING": f"token={TOKEN}"})
        page = r.get_data(as_text=True)
        assert f"location.replace({target})" in page and "<script>\"" not in page, (path, page)


def test_every_request_needs_the_token(tmp_path, caplog):
    client = token_client(tmp_path)
    caplog.set_level(logging.INFO, logger=SECURITY_LOG)
    for path in ("/", "/modules", "/_dash-layout", "/_dash-dependencies", "/assets/style.css",
                 "/_favicon.ico", f"/?token={TOKEN[:-1]}", f"/?token={TOKEN}x"):
        r = client.get(path)
        assert r.status_code == 401 and r.get_data(as_text=True).startswith("401 Unauthorized"), path
    assert client.post("/_dash-update-component", json={}).status_code == 401
    other_port = token_client(tmp_path)
    other_port.set_cookie("modscope_token_8051", TOKEN)                  # another dashboard's cookie
    assert other_port.get("/").status_code == 401
    lines = refusals(caplog)
    assert len(lines) == 10 and sum("wrong token" in line for line in lines) == 2
    assert all(TOKEN[:8] not in line for line in lines)                  # the token is never logged
    fresh = token_client(tmp_path)
    for headers in ({"X-Modscope-Token": TOKEN}, {"Authorization": f"Bearer {TOKEN}"},
                    {"Authorization": f"bearer {TOKEN}"}):
        assert fresh.get("/_dash-layout", headers=headers).status_code == 200, headers
    fresh.set_cookie("modscope_token_8050", TOKEN)
    assert fresh.get("/_dash-layout").status_code == 200


def test_token_bind_accepts_any_host_but_checks_the_origin(tmp_path):
    client = token_client(tmp_path)
    auth = {"X-Modscope-Token": TOKEN}
    assert client.get("/_dash-layout", headers={**auth, "Host": "gpu-box.lan:8050"}).status_code == 200
    body = snapshot_callback_body(client, auth)
    r = client.post("/_dash-update-component", json=body,
                    headers={**auth, "Host": "gpu-box.lan:8050", "Origin": "http://evil.example.com"})
    assert r.status_code == 403
    r = client.post("/_dash-update-component", json=body,
                    headers={**auth, "Host": "gpu-box.lan:8050", "Origin": "http://gpu-box.lan:8050"})
    assert r.status_code in SERVED


def test_loopback_bind_with_a_token_checks_both(tmp_path):
    client = token_client(tmp_path, host="127.0.0.1")
    evil = {"Host": "evil.example.com", "X-Modscope-Token": TOKEN}
    assert client.get("/_dash-layout", headers=evil).status_code == 403
    assert client.get("/_dash-layout", headers={"Host": "localhost:8050"}).status_code == 401
    assert client.get("/_dash-layout", headers={"Host": "localhost:8050", "X-Modscope-Token": TOKEN}).status_code == 200


# -- component suites, framing ----------------------------------------------------------------------
BOGUS_SUITES = ["/_dash-component-suites/nope/x.js", "/_dash-component-suites/dash/nope.js",
                "/_dash-component-suites/dash/deps/react@99.min.js", "/_dash-component-suites/x",
                "/_dash-component-suites/os/path.py", "/_dash-component-suites/dash/../../etc/passwd"]


def test_bogus_component_paths_are_404_without_a_traceback(tmp_path, caplog):
    app = make_app(tmp_path)
    client = app.server.test_client()
    index = client.get("/").get_data(as_text=True)
    real = re.search(r'src="(/_dash-component-suites/[^"]+\.js)"', index).group(1)
    assert client.get(real).status_code == 200
    caplog.set_level(logging.DEBUG)
    for path in BOGUS_SUITES:
        r = client.get(path)
        assert r.status_code == 404 and r.get_data(as_text=True) == "404 Not Found\n", path
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]


def test_pages_may_not_be_framed(tmp_path):
    # by other sites: a notebook served from this machine may (probes.show, docs/security.md)
    client = make_app(tmp_path).server.test_client()
    headers = client.get("/").headers
    assert headers["Content-Security-Policy"] == "frame-ancestors 'self' http://localhost:* http://127.0.0.1:*"
    assert "X-Frame-Options" not in headers


# -- against a real server ----------------------------------------------------------------------------
def status(url: str, headers: dict | None = None, method: str = "GET", data: bytes | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_real_server_refuses_rebinding_and_cross_origin_posts(tmp_path):
    srv = Server(["--run", str(tmp_path / "run")])
    try:
        port = srv.port
        assert status(srv.url + "_dash-layout", {"Host": f"localhost:{port}"}) == 200
        assert status(srv.url + "_dash-layout", {"Host": f"evil.example.com:{port}"}) == 403
        post = {"Content-Type": "application/json"}
        assert status(srv.url + "_dash-update-component", {**post, "Origin": "http://evil.example.com"},
                      "POST", b"{}") == 403
        for path in BOGUS_SUITES[:4]:
            assert status(srv.url + path.lstrip("/")) == 404
        out = srv.output()
        refused = [line for line in out.splitlines() if line.startswith("modscope.security: refused")]
        assert len(refused) == 2, out
        assert f"Host 'evil.example.com:{port}'" in refused[0] and "Origin 'http://evil.example.com'" in refused[1]
        assert "Traceback" not in out and "ERROR" not in out, out
    finally:
        srv.stop()


def test_real_server_token_cookie(tmp_path):
    srv = Server(["--run", str(tmp_path / "run"), "--token", TOKEN], host="0.0.0.0")
    try:
        assert f"?token={TOKEN}" in srv.output()
        req = urllib.request.Request(srv.url + f"modules?token={TOKEN}")
        with urllib.request.urlopen(req, timeout=10) as r:
            cookie = r.headers["Set-Cookie"]
            page = r.read().decode()
        assert f"modscope_token_{srv.port}={TOKEN}" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert 'location.replace("/modules")' in page
        assert status(srv.url + "modules", {"Cookie": cookie.split(";")[0]}) == 200
        assert status(srv.url, {"Authorization": f"Bearer {TOKEN}"}) == 200
        assert status(srv.url) == 401
        assert "modscope.security: refused GET '/' from 127.0.0.1 (401): no token" in srv.output()
    finally:
        srv.stop()
