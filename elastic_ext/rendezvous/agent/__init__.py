"""The rendezvous as an agent runs it: torch's handler (``handler``), the join session and
its head path, the keeper thread (``keeper``, with ``run_view``, ``presence``, ``probes``,
``notices``), the lifecycle, the agent's events and Prometheus metrics."""
