"""The node agent's process: one per node, it starts that node's workers and carries out the controller's orders.

Runs in the agent process (``python -m undying.agent.node_agent`` for a simulated node, or inside
``undying run`` on a real one), and in the processes it starts beside the workers: the node's warm
standby (``standby.py``, ``python -m undying.agent.standby``) and the device part of its health check
(``python -m undying.agent.node_check``). Nothing here loads the controller or, in the agent itself, torch.

- ``node_agent.py``: the agent's life with the controller: hello, the poll loop, orders, leaving, stopping;
- ``workers.py``: the node's worker processes: started, replaced, watched, reported, stopped;
- ``procs.py``, ``stopped_workers.py``: process helpers, and the fast signal of a stopped (hung) worker;
- ``standby.py``, ``warm_standby.py``, ``node_standby.py``: the warm standby the workers are forked from;
- ``node_check.py``: the node's health check before it is given ranks;
- ``worker_logs.py``, ``output_relay.py``, ``console_streams.py``: the workers' logs, and which of
  their lines reach the ``undying run`` console.
"""
