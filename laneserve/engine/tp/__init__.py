"""Tensor parallelism for the engine: a model sharded over N rank processes (Megatron-style
column/row-parallel layers, vocab-parallel embedding and LM head), the rank processes that run
it, and rank 0's executor that hides the ranks from the instance runtime.

* :mod:`.layout`   which heads / rows / expert slices / vocab entries each rank owns, and the
                  degree check;
* :mod:`.comm`     the communicator a sharded model calls (all-reduce, logits gather);
* :mod:`.loader`   each rank reads only its slices of the safetensors checkpoint;
* :mod:`.channel`  rank 0's once-per-step broadcast through shared memory;
* :mod:`.step_message` the step's plan as a diff against what the other ranks already hold;
* :mod:`.stop`     the one "stop here?" object every rank asks at an operator boundary;
* :mod:`.worker`   the loop of ranks 1..N-1;
* :mod:`.ray_ranks` on Ray: ranks 1..N-1 as actors in the instance's placement group;
* :mod:`.executor` rank 0: :class:`TPExecutor`, the ``EngineExecutor`` interface over the group.
"""
