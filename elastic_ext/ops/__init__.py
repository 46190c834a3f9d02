"""The operator's commands (``elastic-ext``): ``cli`` (the entry point), ``status`` (``status``
and ``list``: a run read from its store), ``report`` (a run read from its metrics file,
with ``runlog``, the events' analysis, and ``timeline``, the picture). The chaos harness is
``elastic_ext.chaos`` (the ``[chaos]`` extra)."""
