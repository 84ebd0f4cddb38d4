"""What one dashboard shows: the mode and the runs (``AppConfig``), built by ``dashboard.cli``."""

from __future__ import annotations

import dataclasses

from probes.schema import StrEnum

from ..read.run import RunDir
from ..read.store import Store


class Mode(StrEnum):
    LIVE = "live"          # follow a run directory while it is written (polling)
    REVIEW = "review"      # a snapshot (or a finished run directory), read-only, no polling
    COMPARE = "compare"    # two runs or snapshots side by side


@dataclasses.dataclass(frozen=True)
class ServedAt:
    """Where the app is served and with which token (for dashboard.web.security): the address in
    security.check_host's form (the Host check needs it) and the port (None: not served on a known port, as in
    tests; the token cookie is then unnamed)."""

    host: str = "127.0.0.1"
    port: int | None = None
    token: str | None = None


class AppConfig:
    """What the app shows: ``mode`` (a :class:`Mode` or its value), the store (and, to compare,
    the second one) -- a :class:`~dashboard.read.store.Store` as the command line opens it, or a
    :class:`~dashboard.read.run.RunDir` -- how often live mode polls, where it is served and its token
    (``served``, a :class:`ServedAt`), the title and, to compare, the names of the two sides. Bad
    values raise at once, naming the value and what was expected.

    ``source`` (and ``source_b``) is what the pages read: the run directory (every run in it, the
    newest shown unless one is chosen) or the one file. ``store`` stays what was given."""

    def __init__(self, mode: Mode | str, store: Store | RunDir, store_b: Store | RunDir | None = None, *,
                 poll_ms: int = 1000, served: ServedAt = ServedAt(), title: str = "modscope",
                 labels: tuple[str, str] = ("before", "after")) -> None:
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(m.value for m in Mode)}") from None
        if not isinstance(store, (Store, RunDir)):
            raise TypeError("store must be a dashboard.read.store.Store or a dashboard.read.run.RunDir, "
                            f"got {store!r:.80}")
        if self.mode is Mode.COMPARE and not isinstance(store_b, (Store, RunDir)):
            raise TypeError(f"mode 'compare' needs a second store (store_b), got {store_b!r:.80}")
        if isinstance(poll_ms, bool) or not isinstance(poll_ms, int) or poll_ms < 1:
            raise ValueError(f"poll_ms must be a positive int (milliseconds), got {poll_ms!r}")
        self.store = store
        self.store_b = store_b
        self.source = store if isinstance(store, RunDir) else RunDir.from_store(store)
        self.source_b = None if store_b is None else (
            store_b if isinstance(store_b, RunDir) else RunDir.from_store(store_b))
        self.poll_ms = poll_ms
        self.served = served
        self.title = title
        self.labels = labels

    def __repr__(self) -> str:
        return (f"AppConfig(mode={self.mode.value!r}, source={str(self.source.where)!r}, "
                f"source_b={None if self.source_b is None else str(self.source_b.where)!r}, poll_ms={self.poll_ms})")

    @property
    def token(self) -> str | None:
        return self.served.token

    @property
    def live(self) -> bool:
        return self.mode is Mode.LIVE
