"""The store on etcd's v3 API through its HTTP/JSON gateway: ``client`` (requests, endpoint
rotation, auth, TLS) over ``transport`` (kept-alive connections) and ``wire`` (the JSON
encoding), ``watch`` and ``lease`` (the agent's watches and lease), ``backend`` (the
contract) and ``round_store`` (a c10d ``Store`` on etcd for a round's rank assignment)."""
