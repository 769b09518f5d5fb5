"""kvpress:<press>[:int8|:int4] — an adapter family: a press of NVIDIA's kvpress library (KVzip,
SnapKV, …) as a state method. Its fit runs in kvpress's own venv on the same token ids
(nectar/kvpress/bridge.py: prefill under the press, kept keys and values stored at ``bits``, whose
stored bytes are ρ of the document KV); the state never leaves that process, so ``nectar compare``
scores it there (``job``) and ``fit`` here refuses. Reads the document (kvpress's model prefills it).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kvpress.worker import PRESSES, UNAVAILABLE
from ..modules.builder import ModulePlan
from .interface import FitInputs, FittedState, StateMethod

PREFIX = "kvpress:"
BITS = {"int8": 8, "int4": 4}


class PressNameError(ValueError):
    """A ``kvpress:…`` name that names no press that runs here (one line: why)."""


@dataclass(frozen=True)
class KvpressPress(StateMethod):
    press: str  # a name of nectar/kvpress/worker.py PRESSES
    bits: int = 32  # storage precision of its kept keys and values (32, 8, 4)

    name = "kvpress"
    READS = frozenset({"document"})

    @property
    def key(self) -> str:
        """Its system name: ``kvpress:<press>`` with ``:int8`` / ``:int4`` below 32 bits."""
        return f"{PREFIX}{self.press}" + ("" if self.bits == 32 else f":int{self.bits}")

    @property
    def description(self) -> str:
        return PRESSES[self.press][3]

    @classmethod
    def parse(cls, name: str) -> list["KvpressPress"]:
        """``kvpress:<press>[:int8|:int4]`` (or ``kvpress:all[:bits]``) → its presses; one-line errors for
        unknown presses and for presses that need a model-hub download (listed, never dropped)."""
        press, _, precision = name[len(PREFIX):].partition(":")
        if precision and precision not in BITS:
            raise PressNameError(f"system {name!r}: precision {precision!r} is not one of {', '.join(BITS)} "
                                 "(leave it out for float32)")
        if press in UNAVAILABLE:
            raise PressNameError(f"system {name!r} is unavailable offline: {UNAVAILABLE[press]}")
        if press != "all" and press not in PRESSES:
            raise PressNameError(f"unknown kvpress press {press!r}; the presses are {', '.join(PRESSES)} (or all); "
                                 f"unavailable offline: {', '.join(UNAVAILABLE)}")
        return [cls(p, BITS.get(precision, 32)) for p in (PRESSES if press == "all" else [press])]

    def job(self, key: str, rho: float):
        """The bridge's job for this press at budget ``rho`` (scored in kvpress's venv)."""
        from ..kvpress.bridge import PressJob

        return PressJob(key, self.press, rho, self.bits)

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        raise NotImplementedError(f"{self.key}: kvpress keeps its entries in its own venv (nectar/kvpress/bridge.py)")

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedState:
        raise NotImplementedError(f"{self.key}: kvpress fits and scores in its own venv: nectar compare runs it "
                                  "through nectar/kvpress/bridge.py (KvpressPress.job)")
