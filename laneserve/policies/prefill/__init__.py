"""Prefill-instance policies. Baselines: FCFS (DistServe), chunked prefill with EDF.
The paper policies (FlowPrefill S-EDF, Kairos urgency, LAPS lanes) register here too.

Each module here is a policy (it registers a name the registry builds), and ``base`` is the
scheduler they all derive from; the parts they compose live in :mod:`.mechanisms`."""

from laneserve.policies.prefill.adaptive import AdaptivePrefill  # noqa: F401
from laneserve.policies.prefill.base import PrefillScheduler
from laneserve.policies.prefill.cp_edf import ChunkedEDFPrefill
from laneserve.policies.prefill.fcfs import FCFSPrefill
from laneserve.policies.prefill.sedf import SEDFPrefill  # noqa: F401
from laneserve.policies.prefill.kairos import KairosPrefill  # noqa: F401
from laneserve.policies.prefill.laps import LapsPrefill  # noqa: F401  (registers "laps")

__all__ = ["ChunkedEDFPrefill", "FCFSPrefill", "PrefillScheduler"]
