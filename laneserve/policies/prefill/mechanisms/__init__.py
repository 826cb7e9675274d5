"""The parts prefill policies compose, apart from the policies themselves.

A module here registers nothing and is never named in a policy spec: it is a component a policy
holds (S-EDF's ordering, SLO-aware batching and preemptive tasks, held by both ``sedf`` and
``adaptive``; the bimodal lanes ``adaptive`` adds), a rule it calls (the deadline priorities and
TTFT predictor), or a structure it keeps (Kairos' queue columns, LAPS' lanes and AWD state). The
policies, the things the registry names and builds, are the modules of the parent package.

Nothing is imported here, so importing one mechanism loads only what it needs.
"""
