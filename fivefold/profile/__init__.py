"""Profile first: where the time goes, how close to the machine's limits, which lever to pull."""

from fivefold.profile.profiler import ProfileReport, profile
from fivefold.profile.roofline import MachinePeaks, OpCost, classify, measure_peaks
from fivefold.profile.verdict import Verdict, server_verdict, verdicts

__all__ = ["MachinePeaks", "OpCost", "ProfileReport", "Verdict", "classify", "measure_peaks", "profile",
           "server_verdict", "verdicts"]
