"""The rendezvous as an agent runs it: torch's handler (``handler``), the join session and
its head path, the keeper thread (``keeper``, with ``run_view``, ``presence``,
``presence_book``, ``probes``, ``notices``; its deciders are ``protocol.watcher`` and
``protocol.pressure``), the lifecycle, the agent's events and Prometheus metrics."""
