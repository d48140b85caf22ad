"""The relay benchmark: ``python benchmarks/relay/run.py`` (see ``run.py``)."""
