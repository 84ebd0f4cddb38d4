"""Live polling, and the one way page callbacks read the store.

``read_tick(config, rank)`` is one look at the store (a few index-only queries) as a :class:`Tick`
with named fields. The shell keeps it in ``dcc.Store(ids.TICK)``, replaces it only when it
changed, and every page callback that shows store data takes it as its first input.

``reads_store`` wraps such a callback: while the store is not there yet it answers with the
waiting text (or leaves the outputs as they are), when the store cannot be read with the one-line
error, so the callback itself only reads and draws.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dash import Dash, html
from dash.exceptions import PreventUpdate

from .config import AppConfig, Mode
from .data import Liveness, RunState, Store, StoreError, StoreNotReadyError, WriteTrouble


@dataclass(frozen=True)
class Tick:
    """What the last poll saw. Pages compare fields of it to decide what to read again."""

    ready: bool = False               # the store exists with the schema
    error: str | None = None          # the store is there but cannot be read (one line)
    last_step: int | None = None
    stats_step: int | None = None     # the newest step with module statistics
    structure: tuple[int, ...] = ()   # changes when the tree's rows or badges must change
    status: str = ""                  # the header's run status: "running", "stalled: no update for 3 min" ...
    samples_dropped: int = 0
    probe_errors: int = 0
    write_trouble: str = ""           # banner text while (or after) store writes failed
    write_failing: bool = False
    n: int = 0                        # how many changes the poll has seen

    def to_data(self) -> dict[str, Any]:
        """Plain JSON data for ``dcc.Store``."""
        data = dataclasses.asdict(self)
        data["structure"] = list(self.structure)
        return data

    @classmethod
    def from_data(cls, data: object) -> Tick:
        """The Tick a ``dcc.Store`` holds (a not-ready one for anything else)."""
        if not isinstance(data, dict):
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["structure"] = tuple(values.get("structure") or ())
        try:
            return cls(**values)
        except TypeError:
            return cls()

    def same_content(self, other: Tick) -> bool:
        return dataclasses.replace(self, n=0) == dataclasses.replace(other, n=0)


def read_tick(config: AppConfig, rank: int = 0) -> Tick:
    """One look at the store (compare mode has nothing to poll: always ready)."""
    if config.mode is Mode.COMPARE:
        return Tick(ready=True)
    store = config.store
    try:
        if not store.ready():
            return Tick()
        sig = store.change_signature(rank)
        life = store.liveness(rank)
        trouble = store.write_trouble(rank)
    except StoreNotReadyError:
        return Tick()
    except StoreError as exc:
        return Tick(error=str(exc))
    return Tick(ready=True, last_step=sig.last_step, stats_step=sig.stats_step, structure=sig.structure,
                status=status_text(life), samples_dropped=sig.samples_dropped, probe_errors=sig.probe_errors,
                write_trouble=write_trouble_text(trouble) if trouble else "",
                write_failing=bool(trouble and trouble.failing))


# -- texts ----------------------------------------------------------------------------------------
def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def duration_text(seconds: float) -> str:
    """Whole minutes (hours and days when longer): '2 min', '1 h 5 min', '3 d 4 h'."""
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def clock(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def status_text(life: Liveness) -> str:
    if life.state is RunState.STALLED:
        return f"stalled: no update for {duration_text(life.silent_s or 0.0)}"
    if life.state is RunState.ENDED:
        return "ended without close (process gone)"
    if life.state is RunState.UNKNOWN:
        return "starting"
    return str(life.state)


def write_trouble_text(trouble: WriteTrouble) -> str:
    counts = f"{plural(trouble.failed_commits, 'commit')} failed, {plural(trouble.dropped_samples, 'sample')} dropped"
    error = trouble.error or "unknown error"
    if trouble.failing:
        since = f" since {clock(trouble.failing_since)}" if trouble.failing_since else ""
        return (f"Store writes are failing{since}: {error} — {counts}; "
                "training continues and modscope retries")
    return f"The store missed writes: {counts} (last error: {error}) (recovered)"


def waiting_text(store: Store) -> str:
    return f"Waiting for the first sample in {store.where} …"


def header_text(tick: Tick) -> str:
    """The header's step and run status, in every mode."""
    if tick.error:
        return "cannot read the store"
    if not tick.ready:
        return "waiting for the first sample"
    step = "no step yet" if tick.last_step is None else f"step {tick.last_step}"
    return f"{step} · {tick.status}" if tick.status else step


def banner(tick: Tick, store: Store) -> list[html.Div]:
    """What the banner under the header says: the store's error, that it is awaited, that its
    writes fail (or failed)."""
    if tick.error:
        return [html.Div(tick.error, className="banner-error")]
    if not tick.ready:
        return [html.Div(waiting_text(store), className="banner-wait")]
    if tick.write_trouble:
        return [html.Div(tick.write_trouble, className="banner-error" if tick.write_failing else "banner-warn")]
    return []


# -- registering callbacks ---------------------------------------------------------------------------
Answer = Callable[[str], Any]
F = TypeVar("F", bound=Callable[..., Any])


def callback(app: Dash, *dependencies: Any, **options: Any) -> Callable[[F], F]:
    """``app.callback(*dependencies, **options)`` as a typed decorator (Dash's is untyped): it
    registers the function and returns it unchanged."""
    register = app.callback(*dependencies, **options)

    def decorate(fn: F) -> F:
        register(fn)
        return fn
    return decorate



def reads_store(store: Store, *, waiting: Answer | None = None, failed: Answer | None = None,
                tick_first: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a Dash callback that reads ``store``.

    With ``tick_first`` its first input is the tick, handed to it as a :class:`Tick`; while the
    tick is not ready the callback does not run: ``waiting(text)`` answers with the waiting text
    (or ``failed(error)`` when the store cannot be read); without an answer the outputs stay.
    ``StoreNotReadyError`` leaves the outputs as they are; any other ``StoreError`` is answered by
    ``failed(one-line message)`` (the outputs stay without it)."""
    def decorate(callback: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(callback)
        def guarded(*args: Any) -> Any:
            if tick_first:
                tick = Tick.from_data(args[0])
                if not tick.ready:
                    if tick.error and failed is not None:
                        return failed(tick.error)
                    if waiting is None:
                        raise PreventUpdate
                    return waiting(waiting_text(store))
                args = (tick, *args[1:])
            try:
                return callback(*args)
            except StoreNotReadyError:
                raise PreventUpdate from None
            except StoreError as exc:
                if failed is None:
                    raise PreventUpdate from None
                return failed(str(exc))
        return guarded
    return decorate
