"""The commands a line suggests next, in the words of the tool the user typed: `make up
NAME=x` under make (the Makefile's verbs set PSC_VIA_MAKE), else `ps-compose up --name x`
(the pip-installed command, where there is no Makefile)."""

from __future__ import annotations

import os

VIA_MAKE = "PSC_VIA_MAKE"
# make's variables, as the command's flags
_FLAGS = {"NAME": "--name", "WORKERS": "--workers", "CONFIG": "-c", "RUN": "--run", "STRATEGY": "--strategy"}
_SWITCHES = {"RESUME": "--resume", "LOCAL": "--local"}  # VAR=1: the bare flag; VAR=x: --flag=x
_VERBS = {"soak": "chaos soak", "chaos": "chaos"}  # make's targets that are another verb's name


def via_make() -> bool:
    return bool(os.environ.get(VIA_MAKE))


def command(verb: str, **variables: object) -> str:
    """`verb` with `variables` (make's spelling: NAME=..., WORKERS=..., RESUME=1), as the user
    would type it: `make up NAME=x` or `ps-compose up --name x`."""
    if via_make():
        return " ".join(["make", verb, *(f"{k}={v}" for k, v in variables.items())])
    words = ["ps-compose", _VERBS.get(verb, verb)]
    for key, value in variables.items():
        if key in _SWITCHES:
            words.append(_SWITCHES[key] if str(value) == "1" else f"{_SWITCHES[key]}={value}")
        else:
            words += [_FLAGS[key], str(value)]
    return " ".join(words)
