"""The typed specs a deployment is built from, where the runtime's drivers look for them: a policy
spec lives with the policies (their options types are its options), re-exported here."""

from laneserve.policies.spec import PolicySpec, as_spec, colocated_spec

__all__ = ["PolicySpec", "as_spec", "colocated_spec"]
