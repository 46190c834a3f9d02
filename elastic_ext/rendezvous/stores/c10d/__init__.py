"""The embedded store: a c10d TCPStore hosted by one agent (``backend``), and the count of
state writes its waiters block on (``feed``)."""
