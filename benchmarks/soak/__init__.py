"""The soak benchmark: ``python benchmarks/soak/run.py`` (see ``run.py``)."""
