"""One declaration per algorithm: its halves, hyperparameters and paper.

An :class:`Algorithm` names a :class:`~fedadapt.strategies.core.ServerRule`
class, optionally the server half of its own client part (a
:class:`~fedadapt.strategies.local_update.LocalUpdate` subclass, e.g.
FedDyn's α or Fed-LAMB's second moments), and declares each
hyperparameter once as a :class:`Param` (Python keyword, default, bounds or
choices, one-line doc, where the default comes from), shared by both
halves. Everything else is derived from it, so the copies cannot disagree:

* the Message-API class (:meth:`Algorithm.strategy_class` over
  :class:`~fedadapt.strategies.RuleStrategy`) and the legacy class (over
  ``fedadapt.strategies.legacy.LegacyRuleStrategy``, generated for every
  algorithm of :data:`~fedadapt.strategies.ALGORITHMS`), with a real
  signature and a generated docstring;
* the app's strategy (:meth:`Algorithm.from_run_config`);
* the run-config keys ``<algorithm>.<param>`` (``_`` → ``-``, e.g.
  ``feddua.epsilon-g``), hence pyproject's ``[tool.flwr.app.config]``,
  README's configuration and strategies tables and the papers table of
  docs/algorithms.md (``python -m fedadapt.config --write``).

Facts of the round reach both halves: the rule reads |P_t| and the
federation's client count N from its
:class:`~fedadapt.strategies.core.RoundStatistics` (``num_clients``,
``num_nodes``), the local update gets N in ``configure`` and the round's
replies in ``aggregate``. docs/extending.md walks through adding one.

Importable with flwr and numpy alone (no torch).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Unpack

from fedadapt.strategies._message_api import FedAvgKwargs, RuleStrategy
from fedadapt.strategies.core.base import WEIGHTINGS, ServerRule
from fedadapt.strategies.local_update import (
    LocalUpdate,
    build_local_update,
    combine_local_updates,
)
from fedadapt.strategies.param import Paper, Param

__all__ = [
    "AVERAGE_LAST_TWO",
    "Algorithm",
    "Paper",
    "Param",
    "message_class",
    "weighting",
]


@dataclass(frozen=True)
class Algorithm:
    """The declaration of one algorithm: rule class and hyperparameters.

    Attributes
    ----------
    name : str
        Run-config name (``strategy = "feddua"``) and key prefix.
    title : str
        Class name of its strategies (``FedDuA``).
    summary : str
        First line of the classes' docstrings.
    rule : type[ServerRule]
        The update rule built from the params.
    params : tuple[Param, ...]
        The hyperparameters, in signature order.
    adapter : frozenset[str]
        Params that go to the adapter rather than the rule
        (``average_last_two``).
    rule_names : Mapping[str, str]
        Param name → rule keyword where they differ (FedAvgM's
        ``server_learning_rate`` is the rule's ``server_lr``).
    compat : tuple[Param, ...]
        Keywords the classes accept for Flower compatibility and keep as
        attributes without using them (FedAdam's ``eta_l``); no run-config
        key.
    paper : Paper | None
        The paper it follows (README's strategies table cites
        ``paper.short``, docs/algorithms.md ``paper.full``); required of
        the algorithms of :data:`~fedadapt.strategies.ALGORITHMS`.
    server_step : str
        One line of Markdown: the server step, for README's strategies table.
    notes : str
        More docstring text after the summary (paper, choices).
    local_update : type[LocalUpdate] | None
        The server half of the algorithm's own client part (FedDyn's
        :class:`~fedadapt.strategies.feddyn.FedDynLocal`, Fed-LAMB's
        :class:`~fedadapt.strategies.fedlamb.SecondMoments`), built from the
        checked values of its :attr:`LocalUpdate.params`, which must be
        params of the algorithm: one declaration feeds both halves. It runs
        beside a local update the user selects (:meth:`build`); its client
        half is registered under its :attr:`LocalUpdate.name`.
    """

    name: str
    title: str
    summary: str
    rule: type[ServerRule]
    params: tuple[Param, ...]
    adapter: frozenset[str] = frozenset()
    rule_names: Mapping[str, str] = field(default_factory=dict)
    compat: tuple[Param, ...] = ()
    paper: Paper | None = None
    server_step: str = ""
    notes: str = ""
    local_update: type[LocalUpdate] | None = None

    def __post_init__(self) -> None:
        names = [p.name for p in (*self.params, *self.compat)]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a parameter is declared twice: {names}")
        if self.local_update is not None:
            foreign = [p for p in self.local_update.params if p not in self.params]
            if foreign:
                raise ValueError(
                    f"{self.name}: {self.local_update.__name__}.params "
                    f"{[p.name for p in foreign]} are not the algorithm's params "
                    "(declare each once, in both)"
                )

    def key(self, param: Param | str) -> str:
        """Return the run-config key of ``param`` (``feddua.epsilon-g``)."""
        name = param if isinstance(param, str) else param.name
        return f"{self.name}.{name.replace('_', '-')}"

    def build(
        self, values: Mapping[str, Any], local_update: LocalUpdate | None = None
    ) -> tuple[ServerRule, dict[str, Any]]:
        """Return (rule, adapter options) from {param name: value}.

        Every declared param must be given; each is checked (ValueError
        naming it) before the rule is built. The options hold the
        ``local_update`` the strategy runs: the algorithm's own (see
        :attr:`local_update`) combined with the given one.
        """
        unknown = set(values) - {p.name for p in self.params}
        if unknown:
            raise TypeError(f"{self.title}: unknown parameters {sorted(unknown)}")
        checked = {p.name: p.check(values[p.name]) for p in self.params}
        rule_kwargs: dict[str, Any] = {
            self.rule_names.get(n, n): v
            for n, v in checked.items()
            if n not in self.adapter
        }
        options: dict[str, Any] = {
            n: v for n, v in checked.items() if n in self.adapter
        }
        own = None
        if self.local_update is not None:
            own = self.local_update(
                **{p.name: checked[p.name] for p in self.local_update.params}
            )
        options["local_update"] = combine_local_updates(own, local_update)
        return self.rule(**rule_kwargs), options

    def from_run_config(
        self, cfg: Mapping[str, Any]
    ) -> tuple[ServerRule, dict[str, Any]]:
        """Return (rule, adapter options) from a run config's ``<name>.*`` keys.

        The options' ``local_update`` includes the one of run-config
        ``local-update``.
        """
        values = {p.name: cfg[self.key(p)] for p in self.params}
        return self.build(values, build_local_update(cfg))

    def docstring(self, legacy: bool = False, flower: str = "") -> str:
        """Return the classes' numpydoc docstring, generated from the params."""
        lines = [self.summary, ""]
        if self.notes:
            lines += [inspect.cleandoc(self.notes), ""]
        lines += [
            f"Run config: ``strategy = {self.name!r}``, keys ``{self.name}.*``.",
            "",
            "Parameters",
            "----------",
        ]
        for p in (*self.params, *self.compat):
            default = p.python_default(legacy)
            lines.append(f"{p.name} : {type(default).__name__} (default: {default!r})")
            lines.append(f"    {p.describe()}")
        lines += ["**kwargs", f"    Any argument of ``{flower}``."]
        return "\n".join(lines) + "\n"

    def strategy_class(
        self,
        base: type[Any],
        kwargs_type: type[Any],
        *,
        module: str,
        flower: str,
        legacy: bool = False,
    ) -> type[Any]:
        """Return the strategy class of this algorithm over adapter ``base``.

        Its ``__init__`` takes the declared keywords (keyword-only, with
        their defaults, see :meth:`Param.python_default`) plus ``base``'s
        keyword arguments, builds the rule with :meth:`build` and calls
        ``base.__init__(rule, **adapter options, **kwargs)``.
        """
        algorithm = self
        declared = (*self.params, *self.compat)
        defaults = {p.name: p.python_default(legacy) for p in declared}
        compat = {p.name for p in self.compat}

        def __init__(self: Any, **kwargs: Any) -> None:
            values = {n: kwargs.pop(n, d) for n, d in defaults.items()}
            kept = {n: values.pop(n) for n in compat}
            rule, options = algorithm.build(values, kwargs.pop("local_update", None))
            parent: Any = super(cls, self)
            parent.__init__(rule, **options, **kwargs)
            for name, value in kept.items():
                setattr(self, name, value)

        parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
        annotations: dict[str, Any] = {}
        for p in declared:
            kind = type(p.default)
            parameters.append(
                inspect.Parameter(
                    p.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=defaults[p.name],
                    annotation=kind,
                )
            )
            annotations[p.name] = kind
        unpacked = Unpack[kwargs_type]  # type: ignore[valid-type]
        parameters.append(
            inspect.Parameter(
                "kwargs", inspect.Parameter.VAR_KEYWORD, annotation=unpacked
            )
        )
        annotations["kwargs"] = unpacked
        annotations["return"] = None
        __init__.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        __init__.__annotations__ = annotations
        __init__.__qualname__ = f"{self.title}.__init__"
        __init__.__module__ = module
        doc = self.docstring(legacy=legacy, flower=flower)
        cls: type[Any] = type(
            self.title,
            (base,),
            {
                "__init__": __init__,
                "__doc__": doc,
                "__module__": module,
                "algorithm": self,
            },
        )
        return cls


def message_class(algorithm: Algorithm, module: str) -> type[Any]:
    """Return ``algorithm``'s Message-API class (a :class:`RuleStrategy`)."""
    return algorithm.strategy_class(
        RuleStrategy,
        FedAvgKwargs,
        module=module,
        flower="flwr.serverapp.strategy.FedAvg",
    )


def weighting(default: str, source: str) -> Param:
    """Return the ``weighting`` param (client weights ω of Δ̄ and A)."""
    return Param(
        "weighting",
        default,
        "Client weights ω: the papers' uniform mean or "
        "Flower's num-examples weighting.",
        source,
        choices=WEIGHTINGS,
    )


AVERAGE_LAST_TWO = Param(
    "average_last_two",
    True,
    "Evaluate and return (w_t + w_{t+1})/2; training continues from w_{t+1}.",
    "FedExP §5 and FedDuA §5.1 (as in FedExP)",
)
