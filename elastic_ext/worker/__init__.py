"""The worker process: what a training process imports of etcd-ext.

``loop`` (:class:`~elastic_ext.worker.loop.ElasticLoop`, also ``elastic_ext.ElasticLoop``),
``snapshot`` (snapshots and the state hand-off), ``preemption`` (the guard), ``hold``
(a worker whose peer failed waits for its agent), ``distributed`` (the process group) and
``control`` (the worker's end of the channel to its agent). Nothing here imports the
rendezvous: a worker never talks to the store."""
