"""The server half of an algorithm's client-side part (a *local update*).

Some algorithms change what the clients do in a round: FedProx adds a
proximal term to the local loss, SCAFFOLD corrects each local gradient by
control variates, Mime steps with the server's momentum, MOON adds a
contrastive loss. Each is two halves joined by this hook:

- the **server half**, a :class:`LocalUpdate` (NumPy only), given to any
  strategy (``FedDuA(local_update=FedProx(mu=0.01))``; Message API and legacy
  classes alike). Each round it sends every sampled client scalars and named
  arrays (:meth:`LocalUpdate.configure`), screens what clients send back
  (:meth:`LocalUpdate.check_reply`), folds the used replies into its own
  state (:meth:`LocalUpdate.aggregate`) and checkpoints that state
  (:meth:`LocalUpdate.state_dict`, saved with the strategy's);
- the **client half**, a :class:`fedadapt.client.local_update.ClientUpdate`
  (torch) registered under the same :attr:`LocalUpdate.name`; fedadapt's
  ClientApp and NumPyClient apply it inside local training.

On the wire (:mod:`fedadapt.strategies.wire`): the scalars join the train
config, with :data:`~fedadapt.strategies.wire.LOCAL_UPDATE` naming the
client half; arrays travel as the ArrayRecord
:data:`~fedadapt.strategies.wire.LOCAL_ARRAYS` in both directions (legacy
API: after the model and the rule's arrays in the parameter list, their
names as a JSON list under the same key in the fit config / fit metrics).
Scalars are namespaced by the algorithm (``fedprox.mu``), as run-config
keys are.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from numpy.typing import NDArray

from fedadapt.registry import Registry
from fedadapt.strategies import wire
from fedadapt.strategies.core import Arrays
from fedadapt.strategies.param import Paper, Param, Scalar

__all__ = [
    "LOCAL_UPDATES",
    "LocalUpdate",
    "LocalUpdates",
    "build_local_update",
    "combine_local_updates",
    "member_kinds",
    "secure_problem",
]


class LocalUpdate:
    """Server half of a local update; this base class sends and keeps nothing.

    Subclasses set :attr:`name` (the client half's registry name) and
    override what they need. All arrays are NumPy; keys of the arrays a
    client sends back are its choice (SCAFFOLD: the trainable arrays' names).
    """

    #: registry name shared by the two halves (run-config ``local-update``)
    name: ClassVar[str] = "none"
    #: the hyperparameters, declared once: constructor keywords of the same
    #: name, run-config keys ``<name>.<param>`` and docs rows derive from them
    params: ClassVar[tuple[Param, ...]] = ()
    #: run-config ``client-optimizer`` values the client half works with
    #: (None: any); e.g. Mime, whose client half sets the step direction for
    #: plain SGD to take. The run config refuses the others.
    client_optimizers: ClassVar[tuple[str, ...] | None] = None
    #: the module that registers the client half (``fedadapt.client.fedprox``);
    #: fedadapt's clients import it when the train config first names
    #: :attr:`name` (:func:`fedadapt.client.local_update.client_update`), so
    #: no other file lists it. None: registered some other way (or none).
    client_module: ClassVar[str | None] = None
    #: the paper of a ``local-update=`` choice (docs/algorithms.md's table)
    paper: ClassVar[Paper | None] = None
    #: under SecAgg+, the rule weighting the revealed mean must have for
    #: :meth:`aggregate_mean` to be exact (None: any; SCAFFOLD's unweighted
    #: sum needs "uniform")
    secure_weighting: ClassVar[str | None] = None

    @classmethod
    def key(cls, param: Param | str) -> str:
        """Return the run-config key of ``param`` (``fedprox.mu``)."""
        name = param if isinstance(param, str) else param.name
        return f"{cls.name}.{name.replace('_', '-')}"

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> LocalUpdate:
        """Build from a validated run config (its ``<name>.<param>`` keys)."""
        return cls(**{p.name: cfg[cls.key(p)] for p in cls.params})

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Return (scalars, named arrays) sent to every client of the round.

        ``model`` is the global model x_t the clients train from;
        ``num_nodes`` the number of nodes the round sampled from (SCAFFOLD's
        N). Scalar keys must be namespaced ``<name>.<param>``.
        """
        return {}, {}

    def check_reply(
        self, arrays: Mapping[str, NDArray[Any]] | None, metrics: Mapping[str, Any]
    ) -> str | None:
        """Return why a train reply's local-update arrays are unusable, or None.

        ``arrays`` is None when the reply carries none. A rejected reply is
        dropped from the round and counted, as any other bad reply. This
        base class accepts only replies without arrays.
        """
        return None if not arrays else f"{self.name} expects no local-update arrays"

    def aggregate(
        self,
        replies: Sequence[Mapping[str, NDArray[Any]] | None],
        weights: Sequence[float],
    ) -> dict[str, float]:
        """Fold the used replies' arrays into the state; return diagnostics.

        Called once per round after the rule's step, with the replies the
        rule used (same order as ``weights``, their ``num-examples``).
        """
        return {}

    def aggregate_mean(
        self, mean: Mapping[str, NDArray[Any]], num_replies: int
    ) -> dict[str, float]:
        """Fold the weighted mean of the replies' arrays into the state.

        Under SecAgg+ (:mod:`fedadapt.strategies.secagg`) the server sees
        no reply's arrays, only Σω_i a_i over the ``num_replies`` clients in
        the sum (ω the rule's weighting). A local update whose server half
        needs no more than that overrides this (with :meth:`secure_ranges`)
        and then runs under SecAgg+ (:meth:`summable`). Returns diagnostics.
        """
        raise NotImplementedError(f"{self.name} has no SecAgg+ aggregation")

    def secure_ranges(self) -> dict[str, float]:
        """Return the range [0, top] of each array a client sends, by name.

        Under SecAgg+ every coordinate is quantised to 2c/Q of its range: a
        range close to the values keeps the error small against them (tiny
        second moments would drown in a step of 2c/Q). Names not listed
        travel as is, within ±c. Called when the round is configured.
        """
        return {}

    def secure_scales(self) -> dict[str, str]:
        """Return the scale each array's values take before their range.

        ``ratio`` (to the array the server sent this round) or ``log``
        (:func:`~fedadapt.strategies.secagg.to_secure_scale`); names not
        listed travel as themselves. :meth:`aggregate_mean` then receives
        the mean in these scales. Called when the round is configured.
        """
        return {}

    @classmethod
    def summable(cls) -> bool:
        """Return whether the server half works from the mean of the arrays.

        True when the class overrides :meth:`aggregate_mean`: its clients'
        arrays then travel masked beside the update under SecAgg+.
        """
        return cls.aggregate_mean is not LocalUpdate.aggregate_mean

    def masks_arrays(self) -> bool:
        """Return whether clients mask this update's arrays under SecAgg+.

        True for a :meth:`summable` update (a combination: if any member's
        is): its clients append their arrays to the masked vector.
        """
        return type(self).summable()

    @classmethod
    def client_only(cls) -> bool:
        """Return whether the server needs nothing from each client but Δ_i.

        True for a local update whose clients send no arrays of their own
        (it keeps the base class's :meth:`check_reply` and :meth:`aggregate`:
        FedProx, MOON). Such a local update runs under SecAgg+, which
        reveals the sum of the updates and nothing per client, as does one
        that is :meth:`summable`.
        """
        return (
            cls.check_reply is LocalUpdate.check_reply
            and cls.aggregate is LocalUpdate.aggregate
        )

    def state_dict(self) -> dict[str, Any]:
        """Return a deep copy of the server half's state (a tree of arrays/scalars)."""
        return copy.deepcopy(self._state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._load(copy.deepcopy(dict(state)))

    def _state(self) -> dict[str, Any]:
        return {}

    def _load(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Override with :meth:`_state`."""

    def describe(self) -> dict[str, Scalar]:
        """Name and hyperparameters (the declared ones), as results.json records."""
        return {
            "name": self.name,
            **{p.name: getattr(self, p.name) for p in self.params},
        }

    def __repr__(self) -> str:
        """``FedProx(mu=0.01)``."""
        params = {k: v for k, v in self.describe().items() if k != "name"}
        shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"{type(self).__name__}({shown})"


#: separates the names of combined local updates on the wire and the
#: member's name from an array's key (``fed-lamb/fc.weight``)
SEPARATOR = "+"
MEMBER = "/"


def split_arrays(
    arrays: Mapping[str, Any], names: Sequence[str]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Split ``<name>/<key>`` arrays by member name; also the keys of no member."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in names}
    unknown = []
    for key, value in arrays.items():
        name, sep, rest = key.partition(MEMBER)
        if sep and name in parts:
            parts[name][rest] = value
        else:
            unknown.append(key)
    return parts, unknown


class LocalUpdates(LocalUpdate):
    """Several local updates in one round (Fed-LAMB's moments with FedProx).

    Our choice: on the wire the members' names are joined by ``+``
    (``local-update = "fed-lamb+fedprox"``; the client combines the client
    halves of those names), each member's arrays are keyed
    ``<name>/<key>`` in both directions, its scalars are namespaced as
    always. Each member screens and aggregates its own arrays (a reply one
    member rejects is dropped); the state is kept per member.
    """

    def __init__(self, *updates: LocalUpdate) -> None:
        names = [u.name for u in updates]
        if len(updates) < 2 or len(set(names)) != len(names):
            raise ValueError(f"combine two or more different local updates: {names}")
        self.updates = updates
        # the instance's wire name (the base declares it per class)
        self.name = SEPARATOR.join(names)  # type: ignore[misc]

    def configure(
        self, server_round: int, model: Mapping[str, NDArray[Any]], num_nodes: int
    ) -> tuple[dict[str, Scalar], Arrays]:
        """Return each member's scalars, and its arrays keyed ``<name>/<key>``."""
        scalars: dict[str, Scalar] = {}
        arrays: Arrays = {}
        for update in self.updates:
            own, own_arrays = update.configure(server_round, model, num_nodes)
            scalars.update(own)
            arrays.update(
                {f"{update.name}{MEMBER}{k}": a for k, a in own_arrays.items()}
            )
        return scalars, arrays

    def _split(
        self, arrays: Mapping[str, NDArray[Any]] | None
    ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        return split_arrays(arrays or {}, [u.name for u in self.updates])

    def check_reply(
        self, arrays: Mapping[str, NDArray[Any]] | None, metrics: Mapping[str, Any]
    ) -> str | None:
        """Return the first member's reason to reject its arrays, or None."""
        parts, unknown = self._split(arrays)
        if unknown:
            return f"array '{unknown[0]}' names none of {self.name}"
        for update in self.updates:
            reason = update.check_reply(parts[update.name] or None, metrics)
            if reason is not None:
                return f"{update.name}: {reason}"
        return None

    def aggregate(
        self,
        replies: Sequence[Mapping[str, NDArray[Any]] | None],
        weights: Sequence[float],
    ) -> dict[str, float]:
        """Each member aggregates its part of the replies; their diagnostics."""
        parts = [self._split(r)[0] for r in replies]
        diagnostics: dict[str, float] = {}
        for update in self.updates:
            own = [p[update.name] or None for p in parts]
            diagnostics.update(update.aggregate(own, weights))
        return diagnostics

    def masks_arrays(self) -> bool:
        """Whether any member's arrays travel masked under SecAgg+."""
        return any(u.masks_arrays() for u in self.updates)

    def secure_ranges(self) -> dict[str, float]:
        """Each member's ranges, keyed ``<name>/<key>`` as its arrays are."""
        return {
            f"{u.name}{MEMBER}{k}": top
            for u in self.updates
            for k, top in u.secure_ranges().items()
        }

    def secure_scales(self) -> dict[str, str]:
        """Each member's scales, keyed ``<name>/<key>`` as its arrays are."""
        return {
            f"{u.name}{MEMBER}{k}": scale
            for u in self.updates
            for k, scale in u.secure_scales().items()
        }

    def aggregate_mean(
        self, mean: Mapping[str, NDArray[Any]], num_replies: int
    ) -> dict[str, float]:
        """Each member that sends arrays folds in its part of the mean."""
        parts, unknown = self._split(mean)
        if unknown:
            raise ValueError(f"array '{unknown[0]}' names none of {self.name}")
        diagnostics: dict[str, float] = {}
        for update in self.updates:
            if update.masks_arrays():
                diagnostics.update(
                    update.aggregate_mean(parts[update.name], num_replies)
                )
        return diagnostics

    def _state(self) -> dict[str, Any]:
        return {u.name: u.state_dict() for u in self.updates}

    def _load(self, state: dict[str, Any]) -> None:
        for update in self.updates:  # older checkpoints: not split by member
            update.load_state_dict(state.get(update.name, state))

    def describe(self) -> dict[str, Scalar]:
        """Return the joined name and each member's ``<name>.<param>``."""
        described: dict[str, Scalar] = {"name": self.name}
        for update in self.updates:
            own = update.describe()
            described.update(
                {f"{own['name']}.{k}": v for k, v in own.items() if k != "name"}
            )
        return described


def secure_problem(kinds: Sequence[type[LocalUpdate]], weighting: str) -> str | None:
    """Why local updates of ``kinds`` cannot run under SecAgg+, or None.

    Each must send nothing of its own (:meth:`LocalUpdate.client_only`) or
    need only the mean of what its clients send
    (:meth:`LocalUpdate.summable`), weighted as the rule's ``weighting``
    allows (:attr:`LocalUpdate.secure_weighting`).
    """
    for kind in kinds:
        if not (kind.client_only() or kind.summable()):
            return (
                f"{kind.name} needs each client's arrays; SecAgg+ reveals "
                "only their mean"
            )
        if kind.secure_weighting not in (None, weighting):
            return (
                f"{kind.name} under SecAgg+ needs {kind.secure_weighting} "
                f"weighting (the revealed mean of its arrays is weighted as "
                f"the models), not {weighting}"
            )
    return None


def member_kinds(update: LocalUpdate | None) -> list[type[LocalUpdate]]:
    """Return the classes of ``update``'s members (itself, unless combined)."""
    if update is None:
        return []
    if isinstance(update, LocalUpdates):
        return [type(u) for u in update.updates]
    return [type(update)]


def combine_local_updates(*updates: LocalUpdate | None) -> LocalUpdate | None:
    """Return the local update that runs ``updates`` (None: none of them)."""
    given = [u for u in updates if u is not None]
    if len(given) < 2:
        return given[0] if given else None
    members: list[LocalUpdate] = []
    for update in given:
        members += update.updates if isinstance(update, LocalUpdates) else [update]
    return LocalUpdates(*members)


#: run-config ``local-update`` → server half (its client half has the same name)
LOCAL_UPDATES: Registry[type[LocalUpdate]] = Registry("local-update")
LOCAL_UPDATES.register("none")(LocalUpdate)


def build_local_update(cfg: Mapping[str, Any]) -> LocalUpdate | None:
    """Return the server half of run-config ``local-update`` (None for ``none``)."""
    if cfg["local-update"] == "none":
        return None
    return LOCAL_UPDATES.get(cfg["local-update"]).from_run_config(cfg)


# --- what the adapters call (both Flower APIs) --------------------------------------


def round_config(
    update: LocalUpdate, server_round: int, model: Mapping[str, Any], num_nodes: int
) -> tuple[dict[str, Scalar], Arrays]:
    """Return the train-config entries and arrays of ``update`` for a round."""
    scalars, arrays = update.configure(server_round, model, num_nodes)
    return {wire.LOCAL_UPDATE: update.name, **scalars}, arrays


def legacy_names(value: object) -> list[str] | str:
    """Parse the JSON list of array names of a legacy message, or say why not."""
    try:
        names = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return f"'{wire.LOCAL_ARRAYS}' must be a JSON list of array names"
    return names


def screen_replies(update: LocalUpdate | None, candidates: Sequence[Any]) -> None:
    """Mark train replies whose local-update arrays ``update`` rejects.

    ``candidates`` are screened replies (:class:`Candidate`, or a ``str`` for
    a failed one); a rejected one gets its ``problem`` set, so the screening
    drops and counts it. Without a local update, a reply that carries
    local-update arrays anyway is rejected too (never silently ignored).
    """
    for candidate in candidates:
        if isinstance(candidate, str) or candidate.problem is not None:
            continue
        arrays = candidate.local_arrays
        if update is None:
            if arrays:
                candidate.problem = "local-update arrays sent, but no local update runs"
            continue
        reason = update.check_reply(arrays, candidate.metrics)
        if reason is not None:
            candidate.problem = f"{update.name}: {reason}"


def aggregate_replies(
    update: LocalUpdate | None, used: Sequence[Any], weight_key: str
) -> dict[str, float]:
    """Give the used replies' local-update arrays to ``update``; its diagnostics."""
    if update is None:
        return {}
    return update.aggregate(
        [c.local_arrays for c in used], [float(c.metrics[weight_key]) for c in used]
    )
