"""Live polling, the view (which run, which rank), and the one way page callbacks read the store.

``read_tick(config, run, rank)`` is one look at the run directory and the run shown (a few
index-only queries per rank) as a :class:`Tick` with named fields: which run is shown (the newest
while the user has not chosen one, so a training restarted into the same directory appears on its
own), which rank, what changed. The shell keeps it in ``dcc.Store(ids.TICK)``, replaces it only when
it changed, and every page callback that shows store data takes it as its first input and reads the
run and rank it names (:func:`view_of`).

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
from pathlib import Path
from typing import Any, Protocol, TypeVar

from dash import Dash, html
from dash.exceptions import PreventUpdate

from ..read.run import NEWEST, Run, RunInfo, format_ranks, others_note
from ..read.shown_text import TEXT_MAX, clip
from ..read.store import RunState, StoreError, StoreNotReadyError, WriteTrouble, duration_text, status_text
from .config import AppConfig, Mode

__all__ = ["Tick", "banner", "callback", "duration_text", "header_text", "mode_badge", "place_name", "poll_timing",
           "read_tick", "reads_store", "run_name", "status_text", "view_of"]

_TUPLES = ("runs", "ranks", "structure", "findings", "progress")
FINISHED = "finished"
FINISHED_POLL_MS = 10_000     # a finished run: how often the directory is looked at for a new run


@dataclass(frozen=True)
class Tick:
    """What the last poll saw. Pages compare fields of it to decide what to read again."""

    ready: bool = False               # the run exists with the schema
    error: str | None = None          # the store is there but cannot be read (one line)
    run: str = ""                     # the key of the run shown (its run id; the newest while following)
    runs: tuple[str, ...] = ()        # the keys of the directory's runs, newest first
    rank: int = 0                     # the rank shown
    ranks: tuple[int, ...] = ()       # the run's ranks
    last_step: int | None = None      # of the rank shown
    stats_step: int | None = None     # the newest step with module statistics (rank shown)
    structure: tuple[int, ...] = ()   # changes when the tree's rows or badges must change (rank shown)
    findings: tuple[int, ...] = ()    # changes when a finding of any rank changes
    progress: tuple[int, ...] = ()    # the other ranks' last steps
    status: str = ""                  # the header's run status: "running", "stalled: no update for 3 min" ...
    note: str = ""                    # other ranks that stalled or ended: "rank 1 ended without close"
    samples_dropped: int = 0
    probe_errors: int = 0
    write_trouble: str = ""           # banner text while (or after) store writes failed
    write_failing: bool = False
    warning: str = ""                 # banner text: rank files left out, WAL written from another host
    finished: bool = False            # every rank of the run shown closed its store: nothing more will come
    next_sample: str = ""             # "next full sample at step 512, 1 % budget" (a run that trains)
    name: str = ""                    # the run's name (watch(run_name=...), else its directory's): the header's
    n: int = 0                        # how many changes the poll has seen

    def to_data(self) -> dict[str, Any]:
        """Plain JSON data for ``dcc.Store``."""
        data = dataclasses.asdict(self)
        for key in _TUPLES:
            data[key] = list(getattr(self, key))
        return data

    @classmethod
    def from_data(cls, data: object) -> Tick:
        """The Tick a ``dcc.Store`` holds (a not-ready one for anything else)."""
        if not isinstance(data, dict):
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in _TUPLES:
            values[key] = tuple(values.get(key) or ())
        try:
            return cls(**values)
        except TypeError:
            return cls()

    def same_content(self, other: Tick) -> bool:
        return dataclasses.replace(self, n=0) == dataclasses.replace(other, n=0)

    @property
    def view(self) -> list[Any]:
        """[run, rank]: what selections and expanded nodes are tagged with (another view drops them)."""
        return [self.run, self.rank]


def read_tick(config: AppConfig, run: str | None = None, rank: int | None = None) -> Tick:
    """One look at the run ``run`` (a key; None or ``NEWEST``: the newest) and its rank ``rank`` (None or
    one it does not have: its lowest). Compare mode has nothing to poll: always ready."""
    if config.mode is Mode.COMPARE:
        return Tick(ready=True)
    source = config.source
    runs = tuple(e.key for e in source.entries())
    try:
        shown = source.run(run)
        if not shown.ready():
            return Tick(runs=runs)
        view = shown.view_rank(rank)
        ranks = tuple(shown.ranks())
        sig, findings, progress = shown.change_signature(view)
        health = shown.health()
        sched = shown.at(view).sample_schedule(view)
        name = shown.meta().get("run_name")
    except StoreNotReadyError:
        return Tick()
    except StoreError as exc:
        # the runs stay listed: the selector leads away from a run that cannot be read
        return Tick(error=str(exc), runs=runs, run="" if run in (None, NEWEST) else str(run))
    trouble = _trouble(health.troubles, len(ranks) > 1)
    finished = bool(health.states) and all(life.state is RunState.CLOSED for life in health.states.values())
    return Tick(finished=finished, next_sample="" if finished else sched.next_text(),
                name=clip(str(name)) if name else "", ready=True, run=shown.key, runs=runs, rank=view, ranks=ranks,
                last_step=sig.last_step, stats_step=sig.stats_step, structure=sig.structure, findings=findings,
                progress=progress, status=status_text(health.states[view]), note=others_note(health.states, view),
                samples_dropped=sig.samples_dropped, probe_errors=sig.probe_errors,
                write_trouble=trouble[0], write_failing=trouble[1], warning=" · ".join(health.warnings))


def _trouble(troubles: list[tuple[int, WriteTrouble]], several: bool) -> tuple[str, bool]:
    if not troubles:
        return "", False
    troubles = sorted(troubles, key=lambda t: (not t[1].failing, t[0]))
    rank, first = troubles[0]
    text = write_trouble_text(first)
    if several:
        text = f"rank {rank}: {text}"
        if len(troubles) > 1:
            text += f" (and {format_ranks(r for r, _ in troubles[1:])})"
    return text, any(t.failing for _, t in troubles)


def view_of(config: AppConfig, tick: Tick) -> tuple[Run, int]:
    """The run and rank a tick shows (a run that vanished since: the newest)."""
    run = config.source.run(tick.run or None)
    return run, run.view_rank(tick.rank)


# -- texts ----------------------------------------------------------------------------------------
def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def clock(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def write_trouble_text(trouble: WriteTrouble) -> str:
    counts = f"{plural(trouble.failed_commits, 'commit')} failed, {plural(trouble.dropped_samples, 'sample')} dropped"
    error = clip(trouble.error or "unknown error", TEXT_MAX)
    if trouble.failing:
        since = f" since {clock(trouble.failing_since)}" if trouble.failing_since else ""
        return (f"Store writes are failing{since}: {error} — {counts}; "
                "training continues and modscope retries")
    return f"The store missed writes: {counts} (last error: {error}) (recovered)"


class HasWhere(Protocol):
    @property
    def where(self) -> Any: ...


def waiting_text(source: HasWhere) -> str:
    return f"Waiting for the first sample in {source.where} …"


def place_name(source: HasWhere) -> str:
    """The name of what the dashboard opened (the run directory's, a store file's), without the path to it."""
    where = Path(source.where)
    return clip(where.name or where.resolve().name or str(where))


def run_name(tick: Tick, source: HasWhere) -> str:
    """The header's name of the run shown: the name given to ``watch(run_name=...)`` (the store's meta),
    else the run directory's name; never the path that leads to it (that is the name's tooltip)."""
    return tick.name or place_name(source)


def header_text(tick: Tick) -> str:
    """The header's step and run status, in every mode (with the other ranks that stalled or ended)."""
    if tick.error:
        return "cannot read the store"
    if not tick.ready:
        return "waiting for the first sample"
    step = "no step yet" if tick.last_step is None else f"step {tick.last_step}"
    status = FINISHED if tick.finished else tick.status
    text = f"{step} · {status}" if status else step
    text = f"{text} · {tick.next_sample}" if tick.next_sample else text
    return f"{text} · {tick.note}" if tick.note else text


def mode_badge(live: bool, tick: Tick) -> tuple[str, str]:
    """The header's badge (text, class): a followed run is "live" while it trains and "finished" once every
    rank closed its store (its pages stop polling it); a snapshot is a "snapshot"."""
    if not live:
        return "snapshot", "mode mode-review"
    return (FINISHED, "mode mode-finished") if tick.finished else ("live", "mode mode-live")


def poll_timing(live: bool, tick: Tick, following_newest: bool, poll_ms: int) -> tuple[bool, int]:
    """(the poll's ``disabled``, its ``interval`` in ms): every ``poll_ms`` while the run shown trains; once it
    finished, no poll for a run the user chose, and a look for a new run in the directory every
    ``FINISHED_POLL_MS`` while the dashboard follows the newest (a training restarted into it)."""
    if not live:
        return True, poll_ms
    if not tick.finished:
        return False, poll_ms
    return (False, max(poll_ms, FINISHED_POLL_MS)) if following_newest else (True, poll_ms)


def banner(tick: Tick, source: HasWhere) -> list[html.Div]:
    """What the banner under the header says: the store's error, that it is awaited, that its
    writes fail (or failed), that a rank file was left out."""
    if tick.error:
        return [html.Div(tick.error, className="banner-error")]
    if not tick.ready:
        return [html.Div(waiting_text(source), className="banner-wait")]
    out = []
    if tick.write_trouble:
        out.append(html.Div(tick.write_trouble, className="banner-error" if tick.write_failing else "banner-warn"))
    if tick.warning:
        out.append(html.Div(tick.warning, className="banner-warn"))
    return out


def run_options(infos: list[RunInfo]) -> list[dict[str, str]]:
    """The run selector: "newest" (follows a training restarted into the directory), then every run."""
    if not infos:
        return [{"label": "newest run", "value": NEWEST}]
    return [{"label": f"newest: {infos[0].label()}", "value": NEWEST},
            *({"label": info.label(), "value": info.key} for info in infos)]


def rank_options(ranks: tuple[int, ...] | list[int]) -> list[dict[str, Any]]:
    return [{"label": f"rank {r}", "value": r} for r in (ranks or [0])]


def shown_if(condition: bool) -> dict[str, str]:
    return {} if condition else {"display": "none"}


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


def reads_store(source: HasWhere, *, waiting: Answer | None = None, failed: Answer | None = None,
                tick_first: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a Dash callback that reads the runs of ``source`` (the config's ``RunDir``).

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
                    return waiting(waiting_text(source))
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
