"""The agent process: what torchrun's elastic agent runs of etcd-ext.

``plugin`` is the ``torchrun.handlers`` entry point, ``setup`` the agent's set-up (store,
metrics server, warm fork server, control directory, signal hooks) and the handler it
returns, ``control`` the agent's end of the channel to its workers. The rendezvous itself
is ``elastic_ext.rendezvous`` (shared with the operator commands, which read the same
store); the warm fork server is ``elastic_ext.warm``, whose ``-m elastic_ext.warm``
launcher runs in the workers."""
