"""A model as stages, each with its own jitted forward and backward programs: what the overlapped step runs.

From the ground up, each module importing only those below it (and ``core``, ``memory``, the step's timeline in
``planning``)::

    remat.py           rematerialisation policies: what a block's forward pass keeps for its backward pass
    gather_ahead.py    sharded weights gathered one stage ahead of the backward program that needs them
    stage_rng.py       randomness in a Flax NNX model's stages, drawn as the plain path draws
    micro_batches.py   a step's micro-batches and the order the stages' programs run them in
    stage_programs.py  a stage's jitted programs: forward, and backward summing its gradients in place
    nnx_stage_fns.py   the stage functions built from a Flax NNX model, and the parameter paths they read
    stages.py          Stage and StagedModel: a model as a sequence of stages
    nnx_adapter.py     nnx_stages: a Flax NNX model's own modules as stages, and the way back

It exports nothing; ``jax_dos`` exports the public names (``Stage``, ``StagedModel``, ``nnx_stages``).
"""
