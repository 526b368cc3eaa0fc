"""``algorithm="auto"``: the plan (which algorithm a call runs) and what it remembers.

This module owns every decision ``auto`` makes: :func:`choose` (the cost model's
pick), :func:`plan` (model or measurement, below), :func:`carrying_choice` (when a
settled choice lets the headers travel inside the algorithm's own messages) and
:func:`choose_algorithm` (the public question "what would auto run?"). The
registry (:mod:`.registry`) holds the facts it reads; the headers it reads the
ranks' nnz from are :mod:`.headers`'.

Without a calibration file, measure on first use.

The alpha-beta-gamma model (:mod:`sparcml.costmodel`) ranks the algorithms well
when its constants describe the machine; its defaults describe a network, not
the local work (merging, encoding) that dominates a sparse allreduce on CPUs, so
a fresh user without a calibration file would often get the wrong algorithm.
``auto`` therefore decides in one of two ways:

* **model**: a cost model was passed (``cost_model=``), a calibration file
  exists (``sparcml calibrate``; :func:`sparcml.costmodel.calibration_path`), the
  call is small (the model's best prediction is below :data:`MEASURE_ABOVE_S`,
  where latency dominates and the model is right) and the ranks are not on
  nodes of several ranks (below), or ``SPARCML_AUTO=model``: the candidate with
  the smallest predicted time.
* **measure** (otherwise): the calls of one *class* (world size, ``N`` and the
  mean density rounded to a power of two, value size, codec) run the candidates
  whose predicted time is within :data:`PRUNE_FACTOR` of the best, in turn,
  :data:`ROUNDS` times. Every such call is a real call of an exact algorithm, so
  its result is the sum, bitwise identical on every rank. The call that
  completes the last round also runs one small allreduce (MAX) of every rank's
  timings, so every rank sees the slowest rank's figure of each call; the
  candidate with the smallest figure (the best of its rounds; ties to the
  earlier candidate) is the class's algorithm for the rest of the process, on
  every rank alike (every rank computes the class and the winner from the same
  agreed numbers). When the runner-up's figure is within :data:`CLOSE_FACTOR`
  of the winner's, the two run :data:`CLOSE_ROUNDS` more rounds each and the
  median of all their rounds decides: on a noisy machine two rounds cannot tell
  apart algorithms whose spreads overlap (docs/cluster.md, "auto at 0.1% and 5%"),
  and the best of them would favour one lucky round (:meth:`AutoChoice.score`).

On nodes of several ranks (the two-level algorithms among the candidates) small
calls are measured too: without a calibration file the two levels' constants
are defaults, and there the model both misjudges a small call (at 2 x 4 ranks,
N = 16M, d = 0.1%: 0.83 ms predicted, 17-30 ms taken) and ranks the two-level
arrangements wrongly (docs/cluster.md, "auto at 0.1% and 5%"). On one node a
small call stays the model's: the same algorithm in every run, no measuring
calls. Once a class is decided, :func:`observe` rechecks the winner now and then.

These rules (small calls measured on nodes, more rounds for close calls,
rechecks) go beyond the papers, which fix the algorithm by a model or by hand.

The decisions are logged at INFO on logger ``sparcml`` and listed by
:func:`auto_choices`. Measured on the communicator's clock
(:meth:`~sparcml.comm.Communicator.now`: the wall clock, or the simulator's
virtual clock).

Results of the calls made while measuring come from different algorithms: each
is exact, but a floating-point sum's last bits depend on the order of the
additions, so a run that must repeat bit for bit across restarts should name
its algorithm, pass a ``cost_model`` or keep a calibration file.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import statistics
import weakref
import zlib
from collections.abc import Callable, Sequence

import torch

from ..comm import Communicator
from ..costmodel import CostModel, calibration_path
from ..stream import SparseStream
from .headers import check_consistent
from .registry import AlgorithmInfo, algorithm_info, algorithms, predict

__all__ = [
    "CLOSE_FACTOR",
    "CLOSE_ROUNDS",
    "MEASURE_ABOVE_S",
    "PRUNE_FACTOR",
    "RECHECK_EVERY",
    "RECHECK_FACTOR",
    "ROUNDS",
    "AutoChoice",
    "AutoClass",
    "auto_choices",
    "auto_mode",
    "auto_model",
    "auto_policy",
    "carrying_choice",
    "choose",
    "choose_algorithm",
    "common_choice",
    "measured_candidates",
    "measuring",
    "observe",
    "plan",
    "previous_choice",
    "remember",
    "run_auto",
]

log = logging.getLogger("sparcml")

#: Calls whose best predicted time is below this are decided by the model (on one
#: node; on nodes of several ranks they are measured like the others).
MEASURE_ABOVE_S = 1e-3
#: Candidates predicted more than this many times slower than the best are not tried
#: (the model's measured error on CPU ranks stays within it: docs/cluster.md's
#: "meas/model" column).
PRUNE_FACTOR = 3.0
#: Each candidate runs this many times (round robin); its best round counts, so a
#: cold or disturbed first call does not decide.
ROUNDS = 2
#: A runner-up whose best round is within this factor of the winner's is measured
#: again with the winner, :data:`CLOSE_ROUNDS` more rounds each (once per class).
CLOSE_FACTOR = 1.25
CLOSE_ROUNDS = 2
#: Settled calls of a class between two checks of its winner (one small allreduce).
RECHECK_EVERY = 16
#: A winner whose slowest-rank median over those calls exceeds this many times the
#: runner-up's measured figure (its best round, or its median after a close call)
#: is measured again against the runner-up.
RECHECK_FACTOR = 1.5


def auto_mode(cost_model: CostModel | None) -> str:
    """``"model"`` or ``"measure"``: how ``auto`` decides (see the module docstring)."""
    if cost_model is not None:
        return "model"
    env = os.environ.get("SPARCML_AUTO", "measure").strip().lower()
    if env not in ("measure", "model"):
        raise ValueError(f"SPARCML_AUTO must be 'measure' or 'model', got {env!r}")
    if env == "model" or calibration_path().exists():
        return "model"
    return "measure"


def auto_model(cost_model: CostModel | None) -> CostModel | None:
    """The model ``auto`` decides a call with: ``cost_model``, else the stored
    calibration where ``auto`` decides by the model (:func:`auto_mode`), else None
    (it measures). Loaded once per call and passed on.

    Raises:
        ValueError: an invalid ``SPARCML_AUTO`` or calibration file.
    """
    if cost_model is not None or auto_mode(None) == "measure":
        return cost_model
    return CostModel.load()


def auto_policy(model: CostModel | None) -> str:
    """What ``auto``'s choices depend on beyond a call's agreed numbers, compared
    across ranks in the consistency header (beyond the papers): "" when it measures
    (``model`` None: the default model, the same everywhere), ``model:<fingerprint>``
    of the constants of the ``model`` that decides (:func:`auto_model`: given, or a
    calibration file). Ranks with different models would run different algorithms
    in one call."""
    return "" if model is None else "model:" + _model_print(model)


@functools.lru_cache(maxsize=64)
def _model_print(model: CostModel) -> str:
    constants = dataclasses.replace(model, source="")  # (the file's path may differ)
    return f"{zlib.crc32(repr(constants).encode()):08x}"


@dataclasses.dataclass(frozen=True)
class AutoClass:
    """The calls that share a decision: same ``P``, ``N``, value size and codec, mean
    density within the same power of two."""

    world_size: int
    size: int
    isize: int
    density_log2: int
    lossy: bool

    @classmethod
    def of(
        cls, world_size: int, size: int, ks: Sequence[int], isize: int, lossy: bool
    ) -> AutoClass:
        mean = sum(ks) / max(len(ks), 1)
        d = mean / size if size else 0.0
        return cls(world_size, size, isize, -999 if d <= 0 else round(math.log2(d)), lossy)

    def __str__(self) -> str:
        d = 0.0 if self.density_log2 == -999 else 2.0**self.density_log2
        return f"P={self.world_size} N={self.size:,} d~{d:.3g} isize={self.isize}" + (
            " quantized" if self.lossy else ""
        )


@dataclasses.dataclass
class AutoChoice:
    """One class's measurement: the candidates in the order they ran, the slowest
    rank's seconds of each call of the measurement under way (``rounds`` per
    candidate in ``running``: all of them at first, then the two of a close call
    or a recheck), and the winner."""

    cls: AutoClass
    candidates: list[str]
    running: list[str] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    winner: str | None = None
    agreed: list[float] | None = None
    runner_up: str | None = None  # the second best once decided, and the figure it lost on
    runner_up_s: float = math.inf
    recent: list[float] = dataclasses.field(default_factory=list)  # the winner's, since
    rechecks: int = 0  # times the class was measured again
    checks: int = 0  # checks of the winner so far (see :func:`observe`)
    rounds: int = ROUNDS  # rounds per candidate of the measurement under way
    prior: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # earlier rounds
    extended: bool = False  # the close call's extra rounds ran in this measurement

    def __post_init__(self) -> None:
        if not self.running:
            self.running = list(self.candidates)

    @property
    def calls(self) -> int:
        return len(self.running) * self.rounds

    def rounds_of(self) -> dict[str, list[float]]:
        """Each running candidate's agreed times (seconds), once decided (a close
        call's extra rounds with its first ones)."""
        assert self.agreed is not None
        n = len(self.running)
        return {a: [*self.prior.get(a, []), *self.agreed[i::n]] for i, a in enumerate(self.running)}

    def best(self) -> dict[str, float]:
        """Each candidate's best agreed time (seconds), once decided."""
        return {a: min(ts) for a, ts in self.rounds_of().items()}

    def score(self) -> dict[str, float]:
        """What decides: the best round, or after a close call's extra rounds the
        median of all of a candidate's rounds (a best-of favours one lucky round: at
        P = 8 on two cores ``ssar_recursive_double`` won three close calls in four
        jobs that way, then ran 1.07x-1.16x slower than ``ssar_split_allgather``;
        docs/cluster.md)."""
        if not self.extended:
            return self.best()
        return {a: statistics.median(ts) for a, ts in self.rounds_of().items()}


_CHOICES: weakref.WeakKeyDictionary[Communicator, dict[AutoClass, AutoChoice]] = (
    weakref.WeakKeyDictionary()
)


# per communicator: (N, value size, lossy) -> what the last such call settled on
_SETTLED: weakref.WeakKeyDictionary[Communicator, dict[tuple[int, int, bool], str | None]] = (
    weakref.WeakKeyDictionary()
)


def auto_choices(comm: Communicator) -> list[AutoChoice]:
    """What ``auto`` measured and decided on ``comm`` so far (per class, in order)."""
    return list(_CHOICES.get(comm, {}).values())


def measuring(comm: Communicator, cls: AutoClass | None = None) -> bool:
    """True while some class on ``comm`` (or ``cls``) still has calls to measure."""
    return any(c.winner is None and cls in (None, c.cls) for c in auto_choices(comm))


def measured_candidates(
    model: CostModel, p: int, n: int, ks: Sequence[int], isize: int, names: Sequence[str]
) -> tuple[list[str], float]:
    """The candidates ``auto`` measures for a new class (model's order: those within
    :data:`PRUNE_FACTOR` of the best prediction), and the best prediction.

    Of an algorithm's variants (``twolevel_shard`` and ``twolevel_shard+...``, its
    inner algorithm between nodes) only the one the model ranks best is measured."""
    pred = _predicted(model, p, n, ks, isize, names)
    best = min(pred.values())
    pick: dict[str, str] = {}
    for a in names:  # ties keep the earlier name (the base before its variants)
        base = algorithm_info(a).base
        if base not in pick or pred[a] < pred[pick[base]]:
            pick[base] = a
    keep = [
        a for a in names if pick[algorithm_info(a).base] == a and pred[a] <= PRUNE_FACTOR * best
    ]
    return sorted(keep, key=lambda a: pred[a]), best


def _predicted(
    model: CostModel, p: int, n: int, ks: Sequence[int], isize: int, names: Sequence[str]
) -> dict[str, float]:
    """``predict`` of each name, kept per (model, sizes, registered facts): ``auto``
    asks it on every call of a class the model decides, and a name registered again
    (its facts in the key) is costed again."""
    infos = tuple(algorithm_info(a) for a in names)
    return dict(zip(names, _predictions(model, p, n, tuple(ks), isize, infos), strict=True))


@functools.lru_cache(maxsize=256)
def _predictions(
    model: CostModel,
    p: int,
    n: int,
    ks: tuple[int, ...],
    isize: int,
    infos: tuple[AlgorithmInfo, ...],
) -> tuple[float, ...]:
    return tuple(predict(model, i.name, p, n, ks, isize) for i in infos)


def plan(
    comm: Communicator,
    size: int,
    ks: Sequence[int],
    isize: int,
    lossy: bool,
    cost_model: CostModel | None,
    create: bool,
) -> tuple[str | None, AutoChoice | None]:
    """``auto``'s plan for a call. ``(name, None)``: run ``name`` without measuring
    (the model's choice, a small call, or the class's winner); ``(None, entry)``:
    the class is being measured (its entry created here if new and ``create``);
    ``(None, None)``: a new class that needs measuring, not created. The same on
    every rank (computed from agreed numbers)."""
    p = comm.world_size
    names, model = _for_topology(comm, cost_model, lossy)
    if auto_mode(cost_model) == "model" or p == 1:
        return choose(model, p, size, ks, isize, names), None
    table = _CHOICES.setdefault(comm, {})
    cls = AutoClass.of(p, size, ks, isize, lossy)
    entry = table.get(cls)
    if entry is None:
        cands, best = measured_candidates(model, p, size, ks, isize, names)
        near = _neighbour_winners(table, cls)
        if near:  # a neighbouring density measured already: its winner and the model's
            # (a variant's winner keeps its algorithm: the model picks the inner here)
            won = {algorithm_info(w).base for w in near}
            cands = [a for a in cands if a == cands[0] or algorithm_info(a).base in won]
        on_nodes = any(algorithm_info(a).two_level for a in names)
        if len(cands) == 1 or (best < MEASURE_ABOVE_S and not on_nodes):
            return cands[0], None
        if not create:
            return None, None
        entry = table[cls] = AutoChoice(cls, cands)
        log.info("sparse_allreduce auto: measuring %s for %s", ", ".join(cands), cls)
    return (entry.winner, None) if entry.winner is not None else (None, entry)


def _for_topology(
    comm: Communicator, cost_model: CostModel | None, exclude_dense: bool
) -> tuple[list[str], CostModel]:
    """``auto``'s candidates and model on ``comm``'s topology: the two-level
    algorithms join when the ranks span several nodes of several ranks each, and
    the model then costs flat algorithms with the node's ranks sharing its NIC."""
    model = cost_model if cost_model is not None else CostModel.load()
    topo = comm.topology if comm.world_size > 1 else None
    two_level = topo is not None and not topo.is_flat
    names = [
        a
        for a in algorithms(auto=True)
        if not (exclude_dense and a == "dense") and (two_level or not algorithm_info(a).two_level)
    ]
    if two_level:
        assert topo is not None
        model = model.for_topology(topo.ranks_per_node)
    return names, model


def remember(comm: Communicator, key: tuple[int, int, bool], name: str | None) -> None:
    """Note what ``auto`` settled on for the calls of ``key`` = (N, value size, lossy)
    (what :func:`plan` would run for the last call without measuring, or None)."""
    _SETTLED.setdefault(comm, {})[key] = name


def previous_choice(comm: Communicator, key: tuple[int, int, bool]) -> str | None:
    """What ``auto`` settled on in the last call of ``key`` on ``comm`` (or None).

    Every rank that made the same calls holds the same answer, so ``auto`` may run
    that algorithm before it has every rank's nnz when the algorithm carries the
    headers in its own rounds (registered ``header_in_rounds``), and take the nnz
    from there for the next call's choice.
    """
    return _SETTLED.get(comm, {}).get(key)


def common_choice(comm: Communicator) -> str | None:
    """The one algorithm every call of ``auto`` on ``comm`` settled on so far, whatever
    its N, value size and codec (None: none yet, several, or one still measured).

    Depends on the shared history alone, not on this call's arguments, so every
    rank gets the same answer even for a call whose arguments differ between
    ranks: ``auto`` may then run that algorithm with the header in its own
    messages (any registered ``header_in_first_round`` or ``header_in_rounds``),
    and a mismatched call is refused inside it on every rank.
    """
    seen = set(_SETTLED.get(comm, {}).values())
    return seen.pop() if len(seen) == 1 else None


def run_auto(
    comm: Communicator,
    planned: tuple[str | None, AutoChoice | None],
    run: Callable[[str], object],
) -> object:
    """Run ``auto``'s algorithm for this call, ``run(name)``, as :func:`plan` (with
    ``create=True``) planned it: the settled algorithm, or the class's next
    candidate while it is measured (deciding the winner after the last round).

    The plan comes from every rank's nnz (the consistency check's, the same on
    every rank), so every rank runs the same candidate and picks the same winner.
    """
    settled, entry = planned
    if settled is not None:
        log.debug("sparse_allreduce auto chose %s", settled)
        return run(settled)
    assert entry is not None
    cls = entry.cls
    name = entry.running[len(entry.times) % len(entry.running)]
    t0 = comm.now()
    out = run(name)
    entry.times.append(comm.now() - t0)
    if len(entry.times) == entry.calls:
        with comm.control():
            agreed = comm.allreduce(torch.tensor(entry.times, dtype=torch.float64), op="max")
        entry.agreed = [float(t) for t in agreed]
        best = entry.best()
        score = entry.score()
        ranked = sorted(entry.running, key=lambda a: score[a])  # (ties: earlier first)
        if (
            len(ranked) > 1
            and not entry.extended
            and best[ranked[1]] <= CLOSE_FACTOR * best[ranked[0]]
        ):
            # too close to call on the rounds so far: the two again, more rounds each
            log.info(
                "sparse_allreduce auto: %s: %s %.2f ms and %s %.2f ms within %.2fx: "
                "%d more rounds each",
                cls, ranked[0], best[ranked[0]] * 1e3, ranked[1], best[ranked[1]] * 1e3,
                CLOSE_FACTOR, CLOSE_ROUNDS,
            )  # fmt: skip
            entry.extended = True
            entry.prior = {a: entry.rounds_of()[a] for a in ranked[:2]}
            entry.running, entry.times, entry.agreed = ranked[:2], [], None
            entry.rounds = CLOSE_ROUNDS
            return out
        entry.winner = ranked[0]
        if len(ranked) > 1:
            # (the figure it lost on: its best round, or its median after a close call)
            entry.runner_up, entry.runner_up_s = ranked[1], score[ranked[1]]
        log.info(
            "sparse_allreduce auto: %s -> %s (slowest rank, %s of %d: %s)",
            cls,
            entry.winner,
            "median" if entry.extended else "best",
            entry.rounds + (ROUNDS if entry.prior else 0),
            ", ".join(f"{a} {t * 1e3:.2f} ms" for a, t in score.items()),
        )
    return out


def _neighbour_winners(table: dict[AutoClass, AutoChoice], cls: AutoClass) -> set[str]:
    """Winners of measured classes one density step (a factor of 2) from ``cls``."""
    return {
        c.winner
        for c in table.values()
        if c.winner is not None
        and dataclasses.replace(c.cls, density_log2=cls.density_log2) == cls
        and abs(c.cls.density_log2 - cls.density_log2) <= 1
    }


def observe(
    comm: Communicator,
    size: int,
    ks: Sequence[int],
    isize: int,
    lossy: bool,
    name: str,
    seconds: float,
) -> bool:
    """Note the time of a settled ``auto`` call, and check the class's winner; True
    when the class is to be measured again (from the next call on).

    Every :data:`RECHECK_EVERY` calls run by a class's winner, the ranks agree (one
    small allreduce, MAX) on the median of their times; if it exceeds
    :data:`RECHECK_FACTOR` times the runner-up's best measured time, the class is
    measured again against the runner-up (the winner was chosen on a disturbed
    machine, or the conditions changed). The first check measures the two again
    whatever the figures: the first rounds ran in a young process, whose first
    calls may rank the two otherwise than the calls after (fresh buffers from the
    kernel until the allocator's thresholds have grown: docs/cluster.md, "auto at
    0.1% and 5%"), and this costs ``ROUNDS`` calls of the runner-up once per class.
    Every rank counts the same calls (classes come from agreed nnz), so every rank
    checks at the same call.
    """
    entry = _CHOICES.get(comm, {}).get(AutoClass.of(comm.world_size, size, ks, isize, lossy))
    if entry is None or entry.winner != name or entry.runner_up is None:
        return False
    entry.recent.append(seconds)
    if len(entry.recent) < RECHECK_EVERY:
        return False
    mine = statistics.median(entry.recent) if entry.checks else 0.0  # (first: unused)
    entry.recent.clear()
    entry.checks += 1
    if entry.checks == 1:
        log.info(
            "sparse_allreduce auto: %s: %s settled for %d calls: measuring it against "
            "%s again",
            entry.cls, name, RECHECK_EVERY, entry.runner_up,
        )  # fmt: skip
    else:
        with comm.control():
            agreed = comm.allreduce(torch.tensor([mine], dtype=torch.float64), op="max")
        if float(agreed[0]) <= RECHECK_FACTOR * entry.runner_up_s:
            return False
        log.info(
            "sparse_allreduce auto: %s: %s took %.2f ms (median, slowest rank) against "
            "%s's %.2f ms when measured: measuring them again",
            entry.cls, name, float(agreed[0]) * 1e3, entry.runner_up,
            entry.runner_up_s * 1e3,
        )  # fmt: skip
    entry.running = [name, entry.runner_up]
    entry.times, entry.agreed, entry.winner = [], None, None
    entry.rounds, entry.prior, entry.extended = ROUNDS, {}, False  # (may be close again)
    entry.runner_up, entry.runner_up_s = None, math.inf
    entry.rechecks += 1
    return True


def choose(
    model: CostModel,
    world_size: int,
    size: int,
    ks: Sequence[int],
    isize: int,
    candidates: Sequence[str] | None = None,
) -> str:
    """The candidate (default: ``auto``'s) with the smallest predicted time.

    Ties go to the candidate with the lower ``auto_priority``.
    """
    if candidates is not None:
        names = list(candidates)
    else:  # the two-level ones only where the model is for several ranks per node
        names = [
            a
            for a in algorithms(auto=True)
            if model.ranks_per_node > 1 or not algorithm_info(a).two_level
        ]
    names.sort(key=lambda a: algorithm_info(a).auto_priority)
    pred = _predicted(model, world_size, size, ks, isize, names)
    return min(names, key=pred.__getitem__)


def choose_algorithm(
    stream: SparseStream,
    comm: Communicator,
    cost_model: CostModel | None = None,
    exclude_dense: bool = False,
) -> str:
    """The algorithm ``"auto"`` picks for this call (a collective: every rank must call it).

    Checks consistency like :func:`sparse_allreduce` and returns the same name on
    every rank: the measured winner of the call's class once ``auto`` has measured
    it (:mod:`.autotune`), else the cost model's choice. ``exclude_dense`` leaves out
    the dense allreduce (it cannot quantize).
    """
    ks = check_consistent(stream, comm)
    isize = stream.values.element_size()
    if auto_mode(cost_model) == "measure":
        cls = AutoClass.of(comm.world_size, stream.size, ks, isize, exclude_dense)
        done = next((c for c in auto_choices(comm) if c.cls == cls and c.winner), None)
        if done is not None and done.winner is not None:
            return done.winner
    candidates, model = _for_topology(comm, cost_model, exclude_dense)
    return choose(model, comm.world_size, stream.size, ks, isize, candidates)


def carrying_choice(comm: Communicator, key: tuple[int, int, bool]) -> str | None:
    """The algorithm ``auto`` may run with the headers in its own messages, skipping
    their exchange (None: exchange first).

    Every rank must then run the same messages, also when the call's arguments
    differ between ranks (the error must be the same everywhere, never a hang):

    * every ``auto`` call on ``comm`` so far settled on one algorithm that carries
      headers (:func:`~.autotune.common_choice`) and returns a sparse result: chosen
      from the shared history alone, so the same on every rank whatever its
      arguments;
    * else the previous call of this ``key`` settled on recursive doubling
      (``header_in_rounds``): a rank whose key says otherwise exchanges first,
      which sends the same messages as recursive doubling, and its header's
      "carried" bit makes every rank refuse the mix (on a communicator whose
      exchange is recursive doubling: one that agrees on failures).
    """
    common = common_choice(comm)
    if common is not None:
        info = algorithm_info(common)
        # (not one whose result is dense: chosen for another N, it would hand a huge
        # sparse vector back as N dense values, its memory unchecked)
        if (info.header_in_first_round or info.header_in_rounds) and not info.dense_result:
            return common
    settled = previous_choice(comm, key)
    if settled is not None and comm.agrees_on_failures and algorithm_info(settled).header_in_rounds:
        return settled
    return None
