"""The Snapshot button's file, served from disk: memory independent of the store's size.

A click asks the server (a Dash callback) to write the snapshot of the run shown into a private temporary folder
(``data.snapshot_to``: streamed, bounded in time); errors come back as one line in the banner, as before. The
callback answers with a one-time URL (``/_modscope/download/<random>/<file name>``) and the file name; a few lines of
script in the page follow it as a download. The route streams the file (werkzeug reads it in blocks) and deletes it
once sent; a file nobody fetched is deleted after ``TTL_S`` (or when the server stops). Every request, this one
included, passes the checks of ``dashboard.web.security`` (Host, Origin, token) first."""

from __future__ import annotations

import atexit
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flask import Flask, Response, abort, send_file

from ..read.run import Run
from ..read.shown_text import file_part
from ..read.store import snapshot_to

ROUTE = "/_modscope/download"
TTL_S = 600.0                 # a snapshot not fetched within this long is deleted
MAX_PENDING = 8               # snapshots kept at once (the oldest goes first)

# followed in the page: a click on a temporary link with ``download`` (the file arrives, the page stays)
FOLLOW_JS = """function (link) {
    if (!link || !link.url) { return window.dash_clientside.no_update; }
    var a = document.createElement("a");
    a.href = link.url;
    a.download = link.filename;
    a.style.display = "none";
    document.body.appendChild(a);
    a.click();
    a.remove();
    return true;
}"""


@dataclass(frozen=True)
class Download:
    """A file made for one download: where the page fetches it and the name it is saved under."""

    url: str
    filename: str


class Downloads:
    """The snapshots made for the page and not fetched yet (one temporary folder per server)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="modscope-downloads-"))
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[Path, str, float]] = {}
        atexit.register(shutil.rmtree, self._dir, True)

    def snapshot(self, run: Run, rank: int, run_name: object) -> Download:
        """The snapshot of every rank of ``run``, ready to be fetched once; named after the run and the newest
        step of ``rank`` in the copy."""
        key = secrets.token_urlsafe(18)
        path = self._dir / f"{key}.sqlite"
        try:
            step = snapshot_to(run.snapshot_files(), path, run.view_rank(rank))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        filename = f"{file_part(run_name)}-step{step}.sqlite"
        with self._lock:
            self._expire(time.monotonic())
            self._pending[key] = (path, filename, time.monotonic())
        return Download(f"{ROUTE}/{key}/{filename}", filename)

    def _expire(self, now: float) -> None:
        stale = [k for k, (_, _, t) in self._pending.items() if now - t > TTL_S]
        stale += sorted((k for k in self._pending if k not in stale), key=lambda k: self._pending[k][2]
                        )[:max(0, len(self._pending) - len(stale) - MAX_PENDING + 1)]
        for k in stale:
            path, _, _ = self._pending.pop(k)
            path.unlink(missing_ok=True)

    def take(self, key: str) -> tuple[Path, str] | None:
        """The file of ``key`` and its name, handed out once."""
        with self._lock:
            entry = self._pending.pop(key, None)
        return None if entry is None else (entry[0], entry[1])

    def install(self, server: Flask) -> None:
        """The route that streams a snapshot once and deletes it."""
        def fetch(key: str, name: str) -> Response:
            found = self.take(key)
            if found is None:
                abort(404)
            path, filename = found
            response = send_file(path, mimetype="application/octet-stream", as_attachment=True,
                                 download_name=filename, max_age=0)
            response.headers["Cache-Control"] = "no-store"
            response.call_on_close(lambda: path.unlink(missing_ok=True))
            return response
        server.add_url_rule(f"{ROUTE}/<key>/<name>", "modscope_download", fetch, methods=["GET"])
