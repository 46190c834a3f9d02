"""Workers for ``tests/test_warm_start.py``, run as scripts or (``warm_output``) as
``-m tests.support.warm_scripts.warm_output``; see README.md."""
