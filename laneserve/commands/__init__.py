"""Sub-commands of the ``laneserve`` CLI, one module each."""
