"""Units of recomputed inputs as plans name them: which values a unit drops, which nodes keep them no longer.

A unit (:mod:`fxplan.capture.recomputed_inputs` finds and runs them) is named in a plan's ``regions`` by a
string that :meth:`Unit.parse` reads back, so a plan stays plain data: the solvers and the plan's summary read
units without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Name prefix of a unit in a plan's ``regions`` (the regions of :mod:`fxplan.capture.regions` are named by their
#: convolution): ``"inputs:"`` and the unit's dropped values, comma-separated.
PREFIX = "inputs:"


@dataclass(frozen=True)
class Unit:
    """Values ``dropped`` (nodes that own their storage) that the ``savers`` keep no longer; each saver's
    backward recomputes those it saves from the unit's ``inputs`` through the nodes ``needs[saver]``."""

    dropped: tuple[str, ...]
    savers: tuple[str, ...]
    saved: tuple[tuple[str, ...], ...]  # per saver, the dropped values it saves
    needs: tuple[tuple[str, ...], ...]  # per saver, the unit's nodes its recipe runs, in graph order

    @property
    def conv(self) -> str:
        """The unit's name in a plan (where :mod:`fxplan.capture.regions`' regions have their convolution's), which
        :meth:`parse` reads back: ``inputs:`` and, per saver, ``saver=saved values=recipe nodes``."""
        return PREFIX + ";".join(f"{s}={','.join(saved)}={','.join(needs)}"
                                 for s, saved, needs in zip(self.savers, self.saved, self.needs))

    @staticmethod
    def parse(name: str) -> Unit:
        savers, saved, needs = zip(*(part.split("=") for part in name[len(PREFIX):].split(";")))
        saved = tuple(tuple(v.split(",")) for v in saved)
        dropped = tuple(dict.fromkeys(v for values in saved for v in values))
        return Unit(dropped, tuple(savers), saved, tuple(tuple(v.split(",")) for v in needs))

    @property
    def recomputed(self) -> tuple[str, ...]:
        """The nodes the backward runs again, as often as it runs them (each saver's recipe once)."""
        return tuple(name for needed in self.needs for name in needed)

    @property
    def removed(self) -> tuple[str, ...]:
        """The nodes of the captured graph that the graph with this unit no longer has (none)."""
        return ()

    @property
    def replaced(self) -> tuple[str, ...]:
        """The nodes of the captured graph that run otherwise in the graph with this unit."""
        return self.savers


# ----------------------------------------------------------------------------------------------
# the runtime
