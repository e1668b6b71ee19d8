"""Every option as the parser, the render and the rules read it: one `Option` per field of
app/options.py's dataclasses, derived from the field (its type, default and metadata).

`OPTIONS` is the table in the order the render writes a service's environment; `BY_NAME`
finds one. An `Option` turns a flag's or a variable's text into its value (`convert`),
checks a value against its choices and bounds (`check`) and writes it back as text (`text`).
Standard library only, like app/options.py: the orchestrator reads it on a host without torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

from app.contract import ENV_PREFIX
from app.options import ALWAYS, OPTION_KEY, SECTIONS, AutoInt
from app.recipes import Problem, Spec, spec_of, spec_text

# auto_int: `auto` or a whole number >= 0; spec: a name, or a mapping {name: ..., keyword: value}
KINDS = ("int", "float", "bool", "str", "auto_int", "spec")
BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True)
class Option:
    """One option as the parser, the render and the rules read it, derived from its field."""

    name: str  # the field's name: the attribute of Config and the topology key
    kind: str  # one of KINDS
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    low: Optional[float] = None  # smallest allowed value (`low_open`: excluded)
    low_open: bool = False
    high: Optional[float] = None  # largest allowed value (`high_open`: excluded)
    high_open: bool = False
    section: str = ""  # the topology section that sets it; "": the render places it, or none
    required: bool = False  # the topology file must give it
    emit: str = ALWAYS
    bool_aliases: tuple[str, str] = ("", "")  # (false, true) -> these choices (a field that was a boolean)
    flag_name: str = ""  # the flag's name when it differs from `name`
    checks: Optional[Callable[[Any], Optional[Problem]]] = None  # a spec's or a name's (app/recipes.py)

    @property
    def env(self) -> str:
        return ENV_PREFIX + (self.flag_name or self.name).upper()

    @property
    def flag(self) -> str:
        return f"--{self.flag_name or self.name}"

    @property
    def key(self) -> str:
        return self.name

    @property
    def topology(self) -> str:
        """ "section.key" of the topology file that sets it; "": none."""
        return f"{self.section}.{self.name}" if self.section else ""

    def convert(self, raw: str) -> Any:
        """`raw` (a flag's or a variable's text) as this option's value; ValueError
        saying what is allowed (the caller names where the text came from)."""
        text = raw.strip()
        if self.bool_aliases[0] and text.lower() in BOOLS:
            return self.bool_aliases[int(BOOLS[text.lower()])]
        if self.kind == "auto_int":
            if text.lower() != "auto" and not text.isdigit():
                raise ValueError(f"{raw!r} is not auto or a whole number >= 0")
            return "auto" if text.lower() == "auto" else int(text)
        if self.kind == "spec":
            value = spec_of(raw)
            self.check(value)
            return value
        if self.kind == "bool":
            if text.lower() not in BOOLS:
                raise ValueError(f"{raw!r} is not one of true, false (or 1, 0)")
            return BOOLS[text.lower()]
        kind = {"int": int, "float": float, "str": str}[self.kind]
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a valid {self.kind}") from None
        self.check(value)
        return value

    def problem(self, value: Any) -> Optional[Problem]:
        """What is wrong with a spec (or a checked name): the key at fault and why; None."""
        return self.checks(value) if self.checks is not None else None

    def check(self, value: Any) -> None:
        """ValueError when `value` is outside the choices or bounds, or a spec with a problem."""
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(f"{problem.key}: {problem.text}" if problem.key else problem.text)
        if self.kind == "spec" or self.checks is not None:
            return
        if self.choices and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        if self.kind == "auto_int":
            if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{value!r} is not auto or a whole number >= 0")
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            raise ValueError(f"{value} must be {'>' if self.low_open else '>='} {_num(self.low)}")
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            raise ValueError(f"{value} must be {'<' if self.high_open else '<='} {_num(self.high)}")

    def text(self, value: Any) -> str:
        """`value` as the environment carries it (what `convert` reads back)."""
        if self.kind == "spec":
            return spec_text(value)
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float):
            return repr(value)
        return str(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _kind(hint: Any) -> tuple[str, tuple[str, ...]]:
    """(kind, choices) of a field's type: int, float, bool, str, a Literal of strings, AutoInt."""
    if hint == AutoInt:
        return "auto_int", ()
    if hint == Spec:
        return "spec", ()
    if typing.get_origin(hint) is Literal:
        return "str", typing.get_args(hint)
    names = {int: "int", float: "float", bool: "bool", str: "str"}
    if hint not in names:
        raise TypeError(f"an option's type must be int, float, bool, str, a Literal or AutoInt, not {hint!r}")
    return names[hint], ()


def _bound(meta: Mapping[str, Any], closed: str, opened: str) -> tuple[Optional[float], bool]:
    if opened in meta:
        return meta[opened], True
    return meta.get(closed), False


def fields_of(cls: type) -> list[Option]:
    """The options of one of SECTIONS' dataclasses (or a subclass: its options alone), in order."""
    hints = typing.get_type_hints(cls)
    section = next(name for base, name in SECTIONS if issubclass(cls, base))
    out = []
    for f in dataclasses.fields(cls):
        extra = f.metadata.get(OPTION_KEY)
        if extra is None:
            continue
        kind, choices = _kind(hints[f.name])
        low, low_open = _bound(f.metadata, "ge", "gt")
        high, high_open = _bound(f.metadata, "le", "lt")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.append(
            Option(
                f.name,
                kind,
                default,
                f.metadata["description"],
                choices,
                low,
                low_open,
                high,
                high_open,
                section,
                extra.required,
                extra.emit,
                extra.bool_aliases,
                extra.flag,
                extra.check,
            )
        )
    return out


OPTIONS: tuple[Option, ...] = tuple(o for cls, _ in SECTIONS for o in fields_of(cls))
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def in_topology(section: str) -> list[Option]:
    """The options a topology section sets, in declaration order."""
    return [o for o in OPTIONS if o.topology and o.section == section]
