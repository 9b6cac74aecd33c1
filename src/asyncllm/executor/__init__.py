"""The executor: the one device thread (``_device``), the ``ModelRunner`` protocol the core drives
it through (``_runner``), and the lookahead that fills in the tokens a step in flight will sample
(``_lookahead``), on that thread."""
