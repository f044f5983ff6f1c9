"""Generate ``docs/strategies-reference.md`` from the strategies' code.

Every public strategy of both Flower APIs and every public rule of
:mod:`fedadapt.strategies.core`, with each constructor parameter, its
default (from the signature) and its meaning (from the numpydoc
``Parameters`` section of the class, else of the Message-API class of the
same name, else of its bases: the adapter, the shared
:class:`~fedadapt.strategies.adapter.RuleHost`, Flower's ``FedAvg``).
``python -m fedadapt.config --write`` writes the file, ``--check`` fails
when it is stale; a parameter without a description is an error, so a new
parameter cannot go undocumented.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

PATH = "docs/strategies-reference.md"

_ENTRY = re.compile(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?::\s*(.*))?$")
_DEFAULT = re.compile(r"\(default:\s*(.*)\)\s*$")
_FLOWER_DEFAULT = re.compile(r"\s*Defaults to .*$")
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod):`~?([^`]*)`")


def parse_parameters(doc: str | None) -> dict[str, tuple[str | None, str]]:
    """Return {name: (default from the type line or None, description)}.

    Reads the numpydoc ``Parameters`` section of a docstring; entries such as
    ``beta_1, beta_2 : float (default: 0.9, 0.99)`` give each name its
    default in turn.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    heads = [
        i
        for i, line in enumerate(lines[:-1])
        if line.strip() == "Parameters" and set(lines[i + 1]) == {"-"}
    ]
    if not heads:
        return {}
    start = heads[0]
    out: dict[str, tuple[str | None, str]] = {}
    names: list[str] = []
    defaults: list[str | None] = []
    body: list[str] = []

    def flush() -> None:
        text = " ".join(" ".join(body).split())
        for i, name in enumerate(names):
            default = defaults[i] if i < len(defaults) else None
            out[name.lstrip("*")] = (default, text)

    for i in range(start + 2, len(lines)):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and set(lines[i + 1]) == {"-"}:
            break  # next section
        if line and not line[0].isspace():
            match = _ENTRY.match(line.strip())
            if match is None:
                break
            flush()
            names = [n.strip() for n in match.group(1).split(",")]
            default = _DEFAULT.search(match.group(2) or "")
            defaults = [] if default is None else _split_defaults(default.group(1))
            body = []
        else:
            body.append(line.strip())
    flush()
    return out


def _split_defaults(text: str) -> list[str | None]:
    return [part.strip() for part in text.split(",")]


def _clean(text: str) -> str:
    """Markdown of a docstring description: roles dropped, pipes escaped."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = text.replace("``", "`")
    text = _FLOWER_DEFAULT.sub("", text)
    return text.replace("|", "\\|")


def _init(cls: type) -> Callable[..., Any]:
    """Return ``cls.__init__`` (its signature and annotations are read)."""
    return cls.__init__  # type: ignore[misc]


def _format_default(value: object) -> str:
    """``repr`` of a default; a function by its name (no address)."""
    name = getattr(value, "__name__", None)
    return name if callable(value) and name else repr(value)


def _signature_defaults(*functions: Callable[..., Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for function in functions:
        for name, param in inspect.signature(function).parameters.items():
            if param.default is not inspect.Parameter.empty:
                out.setdefault(name, _format_default(param.default))
    return out


def own_parameters(cls: type) -> list[str]:
    """Return the named constructor parameters of ``cls`` (no self, no **)."""
    return [
        name
        for name, p in inspect.signature(_init(cls)).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def unpacked_kwargs(cls: type) -> type | None:
    """Return the TypedDict of ``**kwargs: Unpack[...]`` of ``cls``, if any."""
    hints = typing.get_type_hints(_init(cls))
    kwargs = hints.get("kwargs")
    if kwargs is None or typing.get_origin(kwargs) is not typing.Unpack:
        return None
    return typing.get_args(kwargs)[0]  # type: ignore[no-any-return]


def _describe(name: str, sources: Iterable[Any]) -> tuple[str | None, str]:
    """Return (docstring default, description) from the first source with one."""
    found_default = None
    for source in sources:
        default, text = parse_parameters(source.__doc__).get(name, (None, ""))
        found_default = found_default or default
        if text and not text.startswith("See "):
            return found_default, text
    raise RuntimeError(
        f"parameter '{name}' has no description in the docstrings of "
        f"{', '.join(s.__qualname__ for s in sources)}; document it there"
    )


def _table(
    names: Iterable[str], sources: list[Any], signatures: list[Callable[..., Any]]
) -> list[str]:
    defaults = _signature_defaults(*signatures)
    rows = ["| parameter | default | meaning |", "|---|---|---|"]
    for name in names:
        doc_default, text = _describe(name, sources)
        default = defaults.get(name, doc_default or "required")
        rows.append(f"| `{name}` | `{default}` | {_clean(text)} |")
    return rows


def _summary_line(cls: type) -> str:
    return _clean(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]).replace(
        "\n", " "
    )


def _public_classes(module: Any, base: type) -> list[type]:
    return [
        obj
        for obj in (getattr(module, n) for n in module.__all__)
        if isinstance(obj, type) and issubclass(obj, base)
    ]


def _sources(cls: type) -> list[Any]:
    """Where ``cls``'s parameters are described: itself, its twin, its bases.

    The twin is the Message-API strategy of the same name (for a legacy
    strategy ``FedDuA`` or a rule ``FedDuARule``), whose docstring the
    others defer to.
    """
    from fedadapt import strategies

    twin = getattr(strategies, cls.__name__.removesuffix("Rule"), None)
    twins = [twin] if isinstance(twin, type) and twin is not cls else []
    return [cls, *twins, *cls.__mro__[1:-1]]


def _api_section(title: str, module: Any, adapter: type) -> list[str]:
    from fedadapt.strategies._control import RunControl
    from fedadapt.strategies.adapter import RuleHost

    flower = next(c for c in adapter.__mro__ if c.__module__.startswith("flwr."))
    anchor_title = f"Common arguments ({title})"
    anchor = re.sub(r"[^a-z0-9 -]", "", anchor_title.lower()).replace(" ", "-")
    lines = [f"## {title}: `{module.__name__}`", ""]
    common = unpacked_kwargs(adapter)
    assert common is not None, f"{adapter.__name__} takes **kwargs: Unpack[...]"
    for cls in _public_classes(module, adapter):
        sources = _sources(cls)
        lines += [f"### `{cls.__name__}`", "", _summary_line(cls), ""]
        lines += _table(own_parameters(cls), sources, [_init(cls)])
        if unpacked_kwargs(cls) is not None:
            lines += ["", f"Plus the [common arguments](#{anchor})."]
        lines.append("")
    lines += [f"### {anchor_title}", ""]
    lines += [
        "Every strategy above takes these keyword arguments (Flower's own "
        f"`{flower.__module__}.{flower.__name__}` arguments and fedadapt's).",
        "",
    ]
    lines += _table(
        common.__annotations__,
        _sources(adapter),
        [_init(RuleHost), _init(RunControl), _init(flower)],
    )
    return [*lines, ""]


def render() -> str:
    """Return the content of ``docs/strategies-reference.md``."""
    import flwr

    from fedadapt import strategies
    from fedadapt.strategies import core, legacy

    lines = [
        "# Strategy reference",
        "",
        "Generated from the code (signatures and docstrings) by "
        "`python -m fedadapt.config --write`; `--check` fails when it is stale. "
        f"Flower's arguments as in flwr {flwr.__version__}. "
        "Do not edit by hand. How to use the strategies: the README, "
        "[Using the strategies in your own Flower project]"
        "(../README.md#using-the-strategies-in-your-own-flower-project).",
        "",
    ]
    lines += _api_section("Message API", strategies, strategies.RuleStrategy)
    lines += _api_section("Legacy API", legacy, legacy.LegacyRuleStrategy)
    lines += [
        "## Rules: `fedadapt.strategies.core`",
        "",
        "The framework-free update rules the strategies wrap (NumPy only); "
        "`RuleStrategy(rule)` / `LegacyRuleStrategy(rule)` put any of them "
        "into Flower.",
        "",
    ]
    for cls in _public_classes(core, core.ServerRule):
        lines += [f"### `{cls.__name__}`", "", _summary_line(cls), ""]
        lines += _table(own_parameters(cls), _sources(cls), [_init(cls)])
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


# --- the algorithm tables of README.md and docs/algorithms.md ----------------------


def _place(module: str) -> str:
    """``fedadapt.strategies.feddyn`` → `` `strategies.feddyn` ``."""
    return f"`{module.removeprefix('fedadapt.')}`"


def _require_paper(owner: str, paper: Any) -> Any:
    if paper is None:
        raise ValueError(f"{owner} declares no paper (docs/extending.md)")
    return paper


def render_strategies_table() -> str:
    """Return README's strategies table: one row per declared algorithm."""
    from fedadapt.strategies import ALGORITHMS

    rows = [
        "| `strategy=` | class | paper | server step |",
        "|---|---|---|---|",
    ]
    for name in ALGORITHMS.names():
        algorithm = ALGORITHMS.get(name)
        paper = _require_paper(algorithm.title, algorithm.paper)
        rows.append(
            f"| `{name}` | `{algorithm.title}` | {paper.short} | "
            f"{algorithm.server_step} |"
        )
    return "\n".join(rows)


def render_papers_table() -> str:
    """Return docs/algorithms.md's papers table, one row per paper.

    Rows come from the algorithms (:data:`~fedadapt.strategies.ALGORITHMS`),
    the ``local-update=`` choices and the client optimizers
    (:data:`fedadapt.optimizers.PAPERS`); what shares a paper shares a row.
    """
    from fedadapt.optimizers import PAPERS
    from fedadapt.strategies import ALGORITHMS
    from fedadapt.strategies.local_update import LOCAL_UPDATES

    rows: dict[str, tuple[list[str], list[str]]] = {}

    def add(paper: Any, name: str, modules: list[str | None]) -> None:
        names, places = rows.setdefault(paper.full, ([], []))
        names.append(name)
        places += [_place(m) for m in modules if m and _place(m) not in places]

    for name in ALGORITHMS.names():
        algorithm = ALGORITHMS.get(name)
        own = algorithm.local_update
        add(
            _require_paper(algorithm.title, algorithm.paper),
            algorithm.title,
            [algorithm.rule.__module__, None if own is None else own.client_module],
        )
    for name in LOCAL_UPDATES.names():
        update = LOCAL_UPDATES.get(name)
        if name != "none":
            paper = _require_paper(update.__name__, update.paper)
            add(paper, update.__name__, [update.__module__, update.client_module])
    for title, module, paper in PAPERS:
        add(paper, title, [module])
    lines = ["| algorithm | paper | where in fedadapt |", "|---|---|---|"]
    for full, (names, places) in rows.items():
        lines.append(f"| {', '.join(names)} | {full} | {', '.join(places)} |")
    return "\n".join(lines)
