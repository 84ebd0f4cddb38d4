"""The two tiers of a watched run as the watcher drives them, step by step: the sampling policy says whether a step
is a full sample (the watcher arms its capture) or a dense step (:class:`probes.capture.dense.DenseSeries` is armed
and takes its norms once the gradients are final); ``ranks.next_sample`` follows the schedule. Every call into the
dense tier runs under the probe's guard: a failure there is counted and stored, never raised into training."""

from __future__ import annotations

from collections.abc import Callable

from ..model.index import ModelIndex
from ..store import records
from ..store.records import Op
from .dense import DenseRide, DenseSeries
from .guard import ProbeRuntime
from .host_values import Fetched, PendingFetch
from .measure import StepMeasurements, UnitActivity
from .sampling import SamplingPolicy

__all__ = ["StepTiers"]


class StepTiers:
    """The full sample's and the dense tier's schedule of one watcher (``policy``), the dense tier itself, and the
    ``ranks.next_sample`` it announces to readers."""

    def __init__(self, policy: SamplingPolicy, probe: ProbeRuntime, rank: int,
                 submit: Callable[[list[Op], bool], object], series_taken: Callable[[int], None]) -> None:
        """``submit``: the store writer's (ops, droppable); ``series_taken``: called with each dense step stored."""
        self.policy = policy
        self.series = DenseSeries(rank, lambda ops: submit(ops, True), series_taken)
        self._probe = probe
        self._rank = rank
        self._submit = submit
        self.next_sample: int | None = None          # as last written to the store
        self._ride: tuple[PendingFetch, DenseRide] | None = None     # a full sample's copy not read yet, and its ride

    @property
    def armed(self) -> bool:
        """The dense tier takes the step in progress."""
        return self.series.armed

    def begin(self, step: int, arm_full: Callable[[ModelIndex], None], index: ModelIndex) -> None:
        """Step ``step`` begins: a full sample (``arm_full(index)`` arms its capture) or, when it is due, a dense
        step."""
        full = self.policy.should_sample(step)
        if full:
            arm_full(index)
        self.series.arm(not full and self.policy.dense_due(step))
        self.write_next_sample(self.policy.next_sample(step))

    def take_optimizer(self, step: int, index: ModelIndex, opt_index: int) -> None:
        """On a dense step, the norms at watched optimizer ``opt_index``'s step (its gradients final)."""
        if self.series.armed:
            with self._probe.guard("dense"):
                self.series.take_optimizer(step, index, opt_index)

    def end_step(self, step: int, index: ModelIndex, optimizers: bool) -> float | None:
        """The step ends (without a watched optimizer the norms are taken now): the dense tier's own time in it
        (ms), None when it did not run."""
        with self._probe.guard("dense"):
            if self.series.armed and not optimizers:
                self.series.take_all(step, index)
            return self.series.end_step(step)
        return None

    def start_fetch(self, measurements: StepMeasurements) -> PendingFetch:
        """A full sample's one host copy, the dense values waiting on the device riding in it (read by :meth:`read`)."""
        ride = self.series.ride(measurements)
        fetch = measurements.start_fetch()
        self._ride = (fetch, ride) if ride is not None else None
        return fetch

    def read(self, fetch: PendingFetch, activity: UnitActivity, sample_index: int) -> Fetched:
        """The full sample's host values; the dense values that rode in its copy are written."""
        values = fetch.read(activity, sample_index)
        if self._ride is not None and self._ride[0] is fetch:
            ride, self._ride = self._ride[1], None
            self.series.read_ride(ride, values)
        return values

    def flush(self) -> None:
        """Read and write every dense value taken so far (a snapshot: blocking on an accelerator)."""
        with self._probe.guard("dense"):
            self.series.flush()

    def close(self) -> None:
        """Write what is left (the run closes): no further step is taken, no full sample is coming."""
        self.series.arm(False)
        with self._probe.guard("dense"):
            self.series.close()
        self.write_next_sample(None)

    def write_next_sample(self, step: int | None) -> None:
        """``ranks.next_sample``, whenever the schedule moves it (None: the run closed)."""
        if step != self.next_sample:
            self.next_sample = step
            self._submit([self.next_sample_op()], False)

    def next_sample_op(self) -> Op:
        return records.next_sample_op(self._rank, self.next_sample)
