"""What one dashboard shows: the mode and the stores (``AppConfig``), built by ``dashboard.cli``."""

from __future__ import annotations

from probes.schema import StrEnum

from .data import Store


class Mode(StrEnum):
    LIVE = "live"          # follow a run while it is written (polling)
    REVIEW = "review"      # a snapshot, read-only, no polling
    COMPARE = "compare"    # two runs or snapshots side by side


class AppConfig:
    """What the app shows: ``mode`` (a :class:`Mode` or its value), the store (and, to compare,
    the second one), how often live mode polls, the access token and the address served (for
    dashboard.security), the title and, to compare, the names of the two sides. Bad values raise
    at once, naming the value and what was expected."""

    def __init__(self, mode: Mode | str, store: Store, store_b: Store | None = None, *, poll_ms: int = 1000,
                 token: str | None = None, bind_host: str = "127.0.0.1", bind_port: int | None = None,
                 title: str = "modscope", labels: tuple[str, str] = ("before", "after")) -> None:
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(m.value for m in Mode)}") from None
        if not isinstance(store, Store):
            raise TypeError(f"store must be a dashboard.data.Store, got {store!r:.80}")
        if self.mode is Mode.COMPARE and not isinstance(store_b, Store):
            raise TypeError(f"mode 'compare' needs a second store (store_b), got {store_b!r:.80}")
        if isinstance(poll_ms, bool) or not isinstance(poll_ms, int) or poll_ms < 1:
            raise ValueError(f"poll_ms must be a positive int (milliseconds), got {poll_ms!r}")
        self.store = store
        self.store_b = store_b
        self.poll_ms = poll_ms
        self.token = token
        self.bind_host = bind_host      # the address served (security.check_host's form): the Host check needs it
        self.bind_port = bind_port      # None: not served on a known port (tests); the token cookie is then unnamed
        self.title = title
        self.labels = labels

    def __repr__(self) -> str:
        return (f"AppConfig(mode={self.mode.value!r}, store={str(self.store.path)!r}, "
                f"store_b={None if self.store_b is None else str(self.store_b.path)!r}, poll_ms={self.poll_ms})")

    @property
    def live(self) -> bool:
        return self.mode is Mode.LIVE
