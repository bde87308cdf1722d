"""Loaded at start-up by every Python process of a fault test (it is put on PYTHONPATH).

It holds the process still at one chosen file rename — after the bytes are
written under a temporary name, before they get their real name — so the test
can SIGKILL the whole run at exactly that moment. Nothing else is changed.

STAGEREPLAY_PAUSE_AT      substring of the destination path to stop at
STAGEREPLAY_PAUSE_AFTER   how many matching renames of this process to let through first
STAGEREPLAY_PAUSE_MARKER  file written (pid, source, destination) once the process is held
"""

import os

_PATTERN = os.environ.get("STAGEREPLAY_PAUSE_AT")

if _PATTERN:
    import time

    _replace = os.replace
    _allowed = int(os.environ.get("STAGEREPLAY_PAUSE_AFTER", "0"))
    _seen = 0

    def _pausing_replace(source, destination, *args, **kwargs):
        global _seen
        if _PATTERN in os.fspath(destination):
            if _seen >= _allowed:
                with open(os.environ["STAGEREPLAY_PAUSE_MARKER"], "a") as marker:
                    marker.write(f"{os.getpid()} {os.fspath(source)} {os.fspath(destination)}\n")
                while True:
                    time.sleep(60)
            _seen += 1
        return _replace(source, destination, *args, **kwargs)

    os.replace = _pausing_replace
