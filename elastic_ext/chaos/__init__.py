"""The chaos harness: run a local elastic job under a scenario of faults, then check invariants.

``scenario`` parses the scenario text, ``runner`` drives a :class:`~elastic_ext.local.job.LocalJob`
through it (``inject`` does the faults, ``netns`` the network namespaces of a partition,
``reference`` the uninterrupted run to compare with), ``invariants`` judges what was
observed and ``report`` writes the JSON summary and the PNG timeline. ``cli`` is
``elastic-ext chaos``; ``matrix`` holds the built-in scenarios; ``soak`` draws a random
schedule of faults from a seed (``elastic-ext chaos soak``).
"""
