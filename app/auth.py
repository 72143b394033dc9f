"""The token: where it comes from, how a request proves it, the session cookie and the CSRF token."""
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import Request, WebSocket

SESSION_COOKIE = "molt_session"
CSRF_FIELD = "csrf_token"      # hidden form field
CSRF_HEADER = "x-csrf-token"   # what htmx sends (hx-headers on <body>)


def load_or_create_token(home: Path) -> str:
    """$MOLT_TOKEN, else the token saved in the data directory, else a new one saved there (mode 0600)."""
    if os.environ.get("MOLT_TOKEN"):
        return os.environ["MOLT_TOKEN"]
    path = Path(home) / "token"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(24)   # hex, not urlsafe: a leading '-' would read as a flag in `molt runs --token X`
    # O_EXCL: two processes starting at once must not both write a different token
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


class Auth:
    """Checks the token in its three forms. The cookie and the CSRF token are HMACs of the token, so they need no
    server-side state and a new token invalidates every session at once."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty token would let anyone in")
        self.token = token
        self.session = self._derive("session")
        self.csrf = self._derive("csrf")
        self.report = self._derive("report")  # may register external runs, nothing else (`molt token --report`)
        self.tinker = "tml-" + self._derive("tinker")  # the Tinker API's key (`molt token --tinker`; the SDK wants tml-)

    def _derive(self, purpose: str) -> str:
        return hmac.new(self.token.encode(), purpose.encode(), hashlib.sha256).hexdigest()

    def _is_token(self, value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), self.token.encode())

    def _is_session(self, value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), self.session.encode())

    def is_report_token(self, value: str) -> bool:
        return hmac.compare_digest(value.encode(), self.report.encode())

    def check_token(self, value: str | None) -> bool:
        return self._is_token(value)

    def method(self, conn: Request | WebSocket) -> str | None:
        """How this request is authenticated: "bearer", "query", "cookie", or None (not at all)."""
        header = conn.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and self._is_token(value.strip()):
            return "bearer"
        if self._is_token(conn.query_params.get("token")):
            return "query"
        if self._is_session(conn.cookies.get(SESSION_COOKIE)):
            return "cookie"
        return None

    def csrf_ok(self, request: Request, form_value: str | None = None) -> bool:
        """A state-changing request on the strength of the cookie must carry the CSRF token (a form field or the
        htmx header) and must not come from another origin. Bearer and ?token= requests are not forgeable."""
        sent = form_value or request.headers.get(CSRF_HEADER)
        if not sent or not hmac.compare_digest(sent.encode(), self.csrf.encode()):
            return False
        return same_origin(request)


def same_origin(conn: Request | WebSocket) -> bool:
    """False when the browser says the request comes from a page of another origin (no Origin header: not a
    browser's cross-site request, e.g. curl)."""
    origin = conn.headers.get("origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc == conn.headers.get("host")  # "null" (a sandboxed page) never matches
