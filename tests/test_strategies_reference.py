"""docs/strategies-reference.md lists every public strategy parameter (#27 part 8).

The parameters and defaults are enumerated here from the constructors'
signatures (and the ``**kwargs: Unpack[...]`` they accept) and looked up
in the file on disk, so a parameter added anywhere, by anyone, fails this
test until ``python -m fedadapt.config --write`` regenerates the file.
"""

from __future__ import annotations

import inspect
import re
import typing

import pytest
from flwr.server.strategy import Strategy as LegacyFlowerStrategy
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedadapt import reference, strategies
from fedadapt.strategies import core, legacy
from tests.helpers import ROOT

DOC = (ROOT / reference.PATH).read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n")
    pattern = "^#{1,%d} " % len(level)  # noqa: UP031 (braces are the regex's)
    stops = [m.start() for m in re.finditer(pattern, text, re.M) if m.start() > start]
    return text[start : stops[0] if stops else len(text)]


def _rows(text: str) -> dict[str, str]:
    """{parameter: default} of the markdown tables in ``text``."""
    return dict(re.findall(r"^\| `([^`]+)` \| `([^`]*)` \|", text, re.M))


def _classes(module, base) -> list[type]:
    objs = (getattr(module, name) for name in module.__all__)
    return [o for o in objs if isinstance(o, type) and issubclass(o, base)]


def _expected(cls) -> tuple[dict[str, object], list[str]]:
    """Named parameters with defaults, and the keys of ``**kwargs: Unpack[TD]``."""
    own = {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    hints = typing.get_type_hints(cls.__init__)
    kwargs = hints.get("kwargs")
    unpacked = []
    if kwargs is not None and typing.get_origin(kwargs) is typing.Unpack:
        unpacked = list(typing.get_args(kwargs)[0].__annotations__)
    return own, unpacked


def _shown(default: object) -> str:
    if default is inspect.Parameter.empty:
        return "required"
    return default.__name__ if callable(default) else repr(default)


API = [
    ("## Message API: `fedadapt.strategies`", strategies, FlowerStrategy),
    ("## Legacy API: `fedadapt.strategies.legacy`", legacy, LegacyFlowerStrategy),
    ("## Rules: `fedadapt.strategies.core`", core, core.ServerRule),
]


@pytest.mark.parametrize(("heading", "module", "base"), API, ids=lambda x: str(x)[:9])
def test_every_public_parameter_of_every_public_strategy_appears(heading, module, base):
    api = _section(DOC, heading)
    classes = _classes(module, base)
    assert len(classes) >= 8
    for cls in classes:
        own, unpacked = _expected(cls)
        rows = _rows(_section(api, f"### `{cls.__name__}`"))
        for name, default in own.items():
            assert name in rows, f"{cls.__name__}({name}) missing from {reference.PATH}"
            assert rows[name] == _shown(default), (cls.__name__, name)
        if unpacked:
            title = "### Common arguments (" + heading.split(":")[0][3:] + ")"
            common = _rows(_section(api, title))
            missing = set(unpacked) - set(common)
            assert not missing, f"{cls.__name__}: {missing} not in {title}"


def test_paper_options_that_lived_only_in_docstrings_are_listed():
    feddua = _rows(_section(DOC, "### `FedExP`"))
    for name in ("form", "eps_form", "eps_decay", "average_last_two"):
        assert name in feddua
    assert _rows(_section(DOC, "### `FedAdam`"))["bias_correction"] == "'flower'"
    assert "### `FedLAMB`" in DOC and "### `FedAdagrad`" in DOC


def test_the_file_is_what_the_generator_writes():
    import flwr

    written_for = re.search(r"as in flwr (\S+)\. ", DOC)
    assert written_for is not None
    if written_for.group(1) != flwr.__version__:  # Flower's docstrings differ
        pytest.skip(f"generated with flwr {written_for.group(1)}")
    assert reference.render() == DOC, "run `python -m fedadapt.config --write`"


def test_an_undocumented_parameter_is_an_error(monkeypatch):
    class FedNew(strategies.RuleStrategy):
        """A strategy someone added."""

        def __init__(self, *, gamma: float = 0.5, **kwargs) -> None:
            super().__init__(core.FedAvgRule(), **kwargs)

    monkeypatch.setattr(strategies, "FedNew", FedNew, raising=False)
    monkeypatch.setattr(strategies, "__all__", [*strategies.__all__, "FedNew"])
    with pytest.raises(RuntimeError, match="'gamma' has no description"):
        reference.render()
