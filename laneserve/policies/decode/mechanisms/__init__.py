"""The parts decode policies compose, apart from the policies themselves.

A module here registers nothing and is never named in a policy spec: it is a component a policy
holds (the length aligner with its guard, staging and bookkeeping, held by both ``alignedserve``
and ``adaptive``; adaptive decode's offer intake and infeasible-context gate; Kairos' token
pacer) or a structure it keeps (the quad-tree over KV length). The policies, the things the
registry names and builds, are the modules of the parent package.

Nothing is imported here, so importing one mechanism loads only what it needs.
"""
