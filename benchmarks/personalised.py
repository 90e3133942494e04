"""FedSPU next to the personalised partial-model methods — FedPer, LG-FedAvg, FedRep, FedBABU, Ditto — and two dropout
baselines, all evaluated alike: each client's own model on its held-out split (FedSPU's protocol,
:mod:`benchmarks.fedspu`, whose tables and JSON this writes).

Usage::

    python -m benchmarks.personalised [any benchmarks.fedspu option, e.g. --datasets digits --rounds 50]

Defaults added to the FedSPU benchmark's: ``--methods fjord,hermes,fedspu,fedper,lgfedavg,fedrep,fedbabu,ditto``, ``--es
none`` and the tag ``<device>-personalised``; an option given on the command line wins.
"""

from __future__ import annotations

import sys

from benchmarks import device_slug, fedspu

DEFAULTS = {"--methods": "fjord,hermes,fedspu,fedper,lgfedavg,fedrep,fedbabu,ditto", "--es": "none"}


def arguments(argv: list[str]) -> list[str]:
    """``argv`` with this benchmark's defaults for the options it does not give."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in DEFAULTS.items():
        if flag not in given:
            out += [flag, value]
    if "--tag" not in given and "--merge" not in given:
        out += ["--tag", device_slug() + "-personalised"]
    return out


def main(argv=None) -> int:
    return fedspu.main(arguments(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
