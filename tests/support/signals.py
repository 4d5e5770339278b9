"""Signal dispositions for the tests: what a child starts with, and what a test leaves behind.

A process inherits ignored signals across fork and exec. A shell starts a background job
(``cmd &`` in a script, ``nohup``) and many CI agents start their jobs with SIGINT ignored, so
a test run started that way hands SIG_IGN to every process it starts, unless the test says
otherwise: a job sent Ctrl-C then trains on and exits 0, and a test of Ctrl-C fails for a
reason that has nothing to do with distkit. Each test that sends SIGINT starts its children
with :func:`ctrl_c_delivered` (the disposition a job started from a terminal has) and checks
with :func:`assert_takes_ctrl_c` that the child really has it before it sends the signal.

:func:`dispositions` is what ``tests/conftest.py`` compares before and after every test, so a
test (or a library path) that changes a handler and does not put it back fails by name,
instead of breaking whichever test happens to run after it.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

#: the signals whose handlers distkit or the tests touch (``signal.getsignal`` of each).
#: Not SIGCHLD: torch's DataLoader installs its own handler there the first time a loader
#: starts workers, once per process and on purpose (it reports a worker that died), so it
#: stays for the rest of the run, and putting the old one back would switch that off.
WATCHED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGPIPE,
    signal.SIGXFSZ,
)


def dispositions() -> dict[str, Any]:
    """This process's handler for each watched signal, and its wakeup fd."""
    found: dict[str, Any] = {sig.name: signal.getsignal(sig) for sig in WATCHED}
    wakeup = signal.set_wakeup_fd(-1)  # reading it means setting it: put it straight back
    signal.set_wakeup_fd(wakeup)
    found["wakeup_fd"] = wakeup
    return found


def _sigint_to_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python installs its KeyboardInterrupt


def ctrl_c_delivered() -> dict[str, Any]:
    """``subprocess.Popen`` keywords for a child that Ctrl-C reaches: SIGINT at its default
    (a Python child installs ``KeyboardInterrupt``), whatever this process inherited.

    ``preexec_fn`` runs between fork and exec; it only resets one signal, which is safe there
    (the tests start their children from the main thread).
    """
    return {"preexec_fn": _sigint_to_default}


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ctrl_c_ignored() -> dict[str, Any]:
    """``subprocess.Popen`` keywords for a child started as ``nohup`` or ``cmd &`` start it:
    SIGINT ignored."""
    return {"preexec_fn": _sigint_ignored}


def ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (``SigIgn`` of ``/proc/PID/status``, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {bit + 1 for bit in range(64) if mask >> bit & 1}
    raise AssertionError(f"/proc/{pid}/status has no SigIgn line")


def assert_takes_ctrl_c(pid: int) -> None:
    """Fail, naming the cause, when process ``pid`` ignores SIGINT (a Ctrl-C test of it
    could then only fail, or pass for a wrong reason)."""
    assert signal.SIGINT not in ignored_signals(pid), (
        f"process {pid} ignores SIGINT: it inherited SIG_IGN (this test run was started with "
        "SIGINT ignored, as `nohup` or `cmd &` do) and was not started with ctrl_c_delivered()"
    )
