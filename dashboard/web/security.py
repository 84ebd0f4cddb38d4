"""Request-level protection of the dashboard: the bind address, the token, and the Host and
Origin checks that stop DNS rebinding and cross-site requests. docs/security.md is the threat
model; this module is its implementation.

Public API:

- ``check_host(value)``: validate and normalise a ``--host`` value (raises ``ValueError``).
- ``is_loopback(host)``: a normalised bind host that only this machine can reach.
- ``generate_token()`` / ``check_token(token)``: make or validate an access token.
- ``install(server, host=, port=, token=)``: register the checks on the Flask server.

Every refused request gets a one-line plain-text answer and exactly one log line on the
``modscope.security`` logger.
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import json
import logging
import re
import secrets
import urllib.parse

from dash.exceptions import DependencyException
from flask import Flask, Response, request

__all__ = [
    "MIN_TOKEN_LENGTH",
    "TOKEN_COOKIE",
    "TOKEN_HEADER",
    "check_host",
    "check_token",
    "generate_token",
    "install",
    "is_loopback",
    "token_cookie_name",
]

LOGGER = logging.getLogger("modscope.security")

TOKEN_COOKIE = "modscope_token"          # the cookie name is this plus "_<port>" (see token_cookie_name)
TOKEN_HEADER = "X-Modscope-Token"
TOKEN_QUERY = "token"
MIN_TOKEN_LENGTH = 16
GENERATED_TOKEN_BYTES = 32               # secrets.token_urlsafe(32): 43 url-safe characters

# The names a browser uses for this machine. A rebinding attacker controls the name in the Host
# header (it is the attacker's own domain), never one of these.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD"})
COMPONENT_SUITES = "/_dash-component-suites/"
# Who may frame the dashboard: itself, and pages served from this machine's loopback names on any
# port (a Jupyter notebook showing it inline). Every other site is refused by the browser. ([::1]
# cannot be named: CSP's host grammar has no IPv6 literals, and Chromium logs an error for one.)
FRAME_ANCESTORS = "frame-ancestors 'self' http://localhost:* http://127.0.0.1:*"

_PORT = re.compile(r":[0-9]{1,5}")
_HOST_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_TOKEN_CHARS = re.compile(r"^[A-Za-z0-9._~-]+$")   # what survives a URL and a cookie unescaped
_EXPECTED_HOST = "expected an IP address (127.0.0.1, ::1, 0.0.0.0) or a host name (myhost.example.com)"


# -- the bind address ------------------------------------------------------------------------
def _normalise_ip(text: str) -> str | None:
    """The canonical spelling of an IP literal (``[::1]`` and ``0:0::1`` give ``::1``), or None."""
    try:
        return str(ipaddress.ip_address(text[1:-1] if text.startswith("[") and text.endswith("]") else text))
    except ValueError:
        return None


def check_host(value: str) -> str:
    """Validate a ``--host`` value and return it normalised: an IP literal in its canonical form
    (IPv6 without brackets, as the socket layer wants it) or a lower-case host name. Raises
    ValueError with one line naming the value and what was expected.

    An empty value is refused: Dash would replace it with ``$HOST`` from the environment, and
    a stray ``HOST=0.0.0.0`` would then serve every interface without a token."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"--host {value!r}: empty; {_EXPECTED_HOST}")
    text = value.strip()
    ip = _normalise_ip(text)
    if ip is not None:
        return ip
    name = text.lower()
    name = name[:-1] if name.endswith(".") else name
    labels = name.split(".")
    if all(label.isdigit() for label in labels):
        # 999.1.1.1 and 10.1 look like IPv4 and would otherwise pass as (numeric) host names
        raise ValueError(f"--host {value!r}: not an IPv4 address (four numbers 0-255, such as 127.0.0.1)")
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"--host {value!r}: not an IP address or a host name; {_EXPECTED_HOST}")
    return name


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine can connect to: ``localhost`` or a loopback
    IP literal. Any other name needs a token, even one that resolves to 127.0.0.1 today."""
    name = host.strip().lower()
    if name == "localhost":
        return True
    ip = _normalise_ip(name)
    return ip is not None and ipaddress.ip_address(ip).is_loopback


# -- the token -------------------------------------------------------------------------------
def generate_token() -> str:
    return secrets.token_urlsafe(GENERATED_TOKEN_BYTES)


def check_token(token: str) -> str:
    """Return ``token`` if it is usable, else raise ValueError with one line. The message gives
    the token's length, not the token: an error line should not put a secret in a log."""
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"--token: {len(token)} characters, too short; expected at least {MIN_TOKEN_LENGTH} "
                         "(or leave --token out and a 43-character one is generated)")
    if not _TOKEN_CHARS.match(token):
        raise ValueError("--token: contains characters other than A-Z a-z 0-9 - _ . ~; "
                         "expected a token that can travel in a URL unescaped")
    return token


def token_cookie_name(port: int | None) -> str:
    """Cookies are not isolated by port: two dashboards on one host share a cookie jar. A name
    per port keeps the second from overwriting the first one's token."""
    return TOKEN_COOKIE if port is None else f"{TOKEN_COOKIE}_{port}"


# -- Host and Origin -------------------------------------------------------------------------
def split_host_header(value: str) -> tuple[str, int | None] | None:
    """``name[:port]`` or ``[ipv6][:port]`` as (normalised name, port), None if malformed."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        name = _normalise_ip(value[: end + 1]) if end > 0 else None
        if name is None or ":" not in name:
            return None
        rest = value[end + 1:]
    else:
        raw_name, colon, port_text = value.partition(":")
        name = _normalise_ip(raw_name) or raw_name.lower()
        rest = colon + port_text
    if not name:
        return None
    if not rest:
        return name, None
    if not (_PORT.fullmatch(rest) and 0 < int(rest[1:]) < 65536):    # not str.isdigit: "²" is a digit
        return None
    return name, int(rest[1:])


def same_origin(origin: str, scheme: str, host_header: str) -> bool:
    """True when the ``Origin`` header names the origin the request was sent to
    (``scheme://Host``), default ports included. ``null`` and anything unparsable are foreign."""
    try:
        parsed = urllib.parse.urlsplit(origin.strip())
        origin_port = parsed.port
    except ValueError:
        return False
    own = split_host_header(host_header)
    if own is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        return False
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment or parsed.username:
        return False
    default_port = {"http": 80, "https": 443}
    origin_host = _normalise_ip(parsed.hostname) or parsed.hostname
    return (parsed.scheme == scheme and origin_host == own[0]
            and (origin_port or default_port[parsed.scheme]) == (own[1] or default_port.get(scheme)))


def _quoted(value: str | None, limit: int = 120) -> str:
    """A header value fit for a one-line log: repr() escapes newlines; long values are cut."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _refuse(status: int, reason: str, answer: str) -> Response:
    LOGGER.warning("refused %s %s from %s (%d): %s", request.method, _quoted(request.path),
                   request.remote_addr or "?", status, reason)
    resp = Response(f"{status} {answer}\n", status=status, mimetype="text/plain")
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Cache-Control"] = "no-store"
    return resp


def _url_without_token() -> str:
    """This request's path and query minus ``token``: where the browser goes after the cookie is
    set, so that the token leaves the address bar and the history. Relative, and never ``//x``
    (a protocol-relative URL would leave the site)."""
    path = "/" + urllib.parse.quote(request.path, safe="/:@!$&'()*+,;=-._~").lstrip("/")
    kept = [(k, v) for k, v in request.args.items(multi=True) if k != TOKEN_QUERY]
    return path + ("?" + urllib.parse.urlencode(kept) if kept else "")


def _remember_token(cookie_name: str, token: str) -> Response:
    """The answer to a GET with the right ``?token=``: set the cookie and go to the same URL
    without the token, so that it leaves the address bar, the back list and screenshots.

    A page that redirects itself rather than a 303: a link followed from another site (a chat,
    a notebook) starts a cross-site navigation, and the browser does not send a SameSite=Strict
    cookie anywhere along its redirect chain, so a 303 would land on a 401 (even after a reload,
    in Chromium). The page's own navigation is same-origin, so the cookie goes with it;
    ``location.replace`` also drops the token URL from the back list."""
    target = _url_without_token()
    target_js = json.dumps(target).replace("<", "\\u003c")    # cannot close the <script> element
    body = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>modscope</title>"
            f"<script>location.replace({target_js})</script>"
            f"<noscript><meta http-equiv=\"refresh\" content=\"0; url={html.escape(target)}\"></noscript></head>"
            f"<body><a href=\"{html.escape(target)}\">Continue to the dashboard</a></body></html>\n")
    resp = Response(body, status=200, mimetype="text/html")
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.set_cookie(cookie_name, token, httponly=True, samesite="Strict", path="/")
    return resp


def install(server: Flask, *, host: str, port: int | None, token: str | None) -> None:
    """Register the checks on ``server`` (Dash's Flask app), ahead of Dash's own request hooks.

    ``host`` and ``port``: the address the server is bound to (``check_host``'s form).
    On a loopback bind, the Host header must be a loopback name or the bound address
    (DNS rebinding); with a ``token`` (required off loopback), every request must carry it;
    and a request that can change state (anything but GET and HEAD) must not come from a
    foreign Origin (cross-site requests)."""
    loopback = is_loopback(host)
    accepted_hosts = LOOPBACK_NAMES | {_normalise_ip(host) or host.lower()}
    cookie_name = token_cookie_name(port)
    expected = check_token(token).encode() if token is not None else None

    def token_matches(value: str | None) -> bool:
        # compare_digest: the time taken does not reveal how much of a guess was right
        return (expected is not None and bool(value)
                and hmac.compare_digest(str(value).encode("utf-8", "replace"), expected))

    def check_request() -> Response | None:
        host_header = request.headers.get("Host", "")
        if loopback:
            parsed = split_host_header(host_header)
            if parsed is None or parsed[0] not in accepted_hosts:
                return _refuse(403, f"Host {_quoted(host_header)} is not a name of this machine "
                                    "(DNS rebinding guard)",
                               "Forbidden: this dashboard answers to 127.0.0.1, localhost and [::1] only")
        if expected is not None:
            query_token = request.args.get(TOKEN_QUERY)
            query_ok = token_matches(query_token)
            if query_ok and request.method in SAFE_METHODS:
                return _remember_token(cookie_name, token or "")
            auth = request.headers.get("Authorization", "")
            carried = (query_ok
                       or token_matches(request.cookies.get(cookie_name))
                       or token_matches(request.headers.get(TOKEN_HEADER))
                       or (auth[:7].lower() == "bearer " and token_matches(auth[7:].strip())))
            if not carried:
                return _refuse(401, "wrong token" if query_token else "no token",
                               "Unauthorized: modscope needs the token printed when it started "
                               "(open the URL with ?token=...)")
        origin = request.headers.get("Origin")
        if request.method not in SAFE_METHODS and origin is not None \
                and not same_origin(origin, request.scheme, host_header):
            # A missing Origin passes: browsers send one on every cross-origin POST (and
            # Chromium on same-origin ones too); scripts such as urllib send none.
            return _refuse(403, f"Origin {_quoted(origin)} is not this dashboard's (cross-site request)",
                           "Forbidden: cross-origin request")
        if request.path.startswith(COMPONENT_SUITES) and (
                request.url_rule is None or not request.url_rule.rule.startswith(COMPONENT_SUITES)):
            # /_dash-component-suites/x would otherwise fall through to Dash's catch-all page
            return _not_found(None)
        return None

    def _not_found(_exc: Exception | None) -> Response:
        # Dash raises DependencyException for an unknown package or file: a 500 with a
        # traceback in the log, and an answer listing every registered path. A 404 says enough.
        resp = Response("404 Not Found\n", status=404, mimetype="text/plain")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp

    def limit_framing(resp: Response) -> Response:
        # no other site may frame the dashboard (clickjacking on its buttons); a notebook served
        # from this machine (Jupyter on localhost:8888, probes.show()) may. X-Frame-Options
        # cannot name another port, so the CSP directive replaces it.
        resp.headers.setdefault("Content-Security-Policy", FRAME_ANCESTORS)
        return resp

    # first in line, ahead of Dash's own hooks: nothing of Dash runs for a refused request
    server.before_request_funcs.setdefault(None, []).insert(0, check_request)
    server.register_error_handler(DependencyException, _not_found)
    server.after_request(limit_framing)
