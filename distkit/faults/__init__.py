"""One failing rank stops every rank within seconds; a stuck one is named.

- :mod:`._faults`: the fail-fast path around ``fit`` (each rank's error reaches the others,
  the process group is released, the user's ``except``/``finally`` run on every rank);
- :mod:`._watchdog`: a thread per rank that ends a rank blocked after a peer failed, and on
  rank 0 names ranks that stop making progress;
- :mod:`._signals`: SIGINT and SIGTERM during ``fit``, and the end of a rank blocked in a
  collective when one arrives;
- :mod:`._channel`: the key-value side channel beside the collectives that carries failure
  notices, progress and stacks;
- :mod:`._progress`: where each rank is (epoch, step, phase), and who holds the others up;
- :mod:`._last_resort`: the one way to end a process that cannot end any other way.
"""
