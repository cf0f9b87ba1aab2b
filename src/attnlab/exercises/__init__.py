"""The course's exercises: a module per tutorial (``ch01_attention.py``, ...) holding the
reference solutions that the pages show, the tests in ``tests/`` that check a learner's
version, and the tools behind ``attnlab exercises init|check`` (``workspace``)."""
