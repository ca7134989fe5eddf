"""The simulator: run a trace under a memory budget and an eviction policy, in seconds.

It runs the device-free core of :mod:`remat.core` with recorded op times instead of real ops;
``remat sim`` (:mod:`remat.sim.cli`) sweeps traces, policies and budgets and plots the results.
"""

from remat.sim.facts import Facts, facts
from remat.sim.result import Outcome, SimResult
from remat.sim.simulate import simulate, sweep

__all__ = ["Facts", "Outcome", "SimResult", "facts", "simulate", "sweep"]
