"""The ``undying`` command's process: ``undying run`` (the launcher) and the commands that talk to a job.

Runs in the user's shell process (``cli.py`` at the package root is the entry point and dispatches
here), which for ``undying run`` becomes the job's launcher: on node 0 it hosts the controller (a thread
of this process) and on every node it runs or spawns the node's agents (``undying.agent``).

- ``launcher.py``: ``undying run``: the controller on node 0, the node agents, the wait for the job;
  ``ha_node.py``: one node of a job whose controller fails over through etcd;
- ``launch_options.py``, ``torchrun_flags.py``, ``cli_common.py``, ``cli_tls.py``: what the command
  line asked for, checked before anything starts;
- ``console.py``, ``terminal.py``, ``progress.py``: what the user sees while the job runs;
- ``controller_files.py``: the files through which ``undying status RUN_DIR`` finds the controller;
- ``cli_job.py``, ``status_view.py``: ``undying status`` and ``undying stop``;
- ``demo.py``: ``undying demo``.
"""
