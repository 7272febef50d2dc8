"""The host a run lives on, below everything that launches, trains or writes.

- :mod:`.processes`: the launcher owns its ranks (find, stop, outlive-proof them);
- :mod:`.durable`: fsync'd atomic writes;
- :mod:`.extras`: the optional dependencies and the error naming a missing one;
- :mod:`.scripts`: what the runnable torchrun examples share before any rank talks.

Importing this package imports none of them.
"""
