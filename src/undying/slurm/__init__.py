"""Slurm: ``undying run`` inside a step, and the batch script that starts one on N nodes + K spares.

``env`` reads a step's environment (``hostlist`` expands its node lists as ``scontrol show hostnames``
does), ``launch`` fills the flags of ``undying run`` left unsaid from it, ``shared_token`` makes the
job's token once for every node, ``batch`` writes the batch script and ``command`` is the CLI's
``undying slurm sbatch``. Runs in ``undying run`` on each node of a step and in the user's shell;
nothing here is imported by the controller, the agents or the workers.
"""
