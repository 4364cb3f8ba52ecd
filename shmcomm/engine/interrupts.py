# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C while a caller runs the engine's cycles (Engine.serve): raised between cycles, not inside one."""
import signal


class Interrupts:
    """Python raises KeyboardInterrupt in the main thread at whatever line it runs: in a cycle that a caller runs,
    that would stop the cycle halfway, with the peers waiting for the rest of it. So the first time the main thread
    serves, the SIGINT handler is wrapped (once: setting a handler costs 5 us): it calls the previous one at once,
    except while the main thread is in a cycle (`deferring`), where it is called after the cycle (deliver)."""

    def __init__(self):
        self.installed = False
        self.previous = None
        self.deferring = False
        self.caught = None

    def install(self):
        if self.installed:
            return
        self.installed = True
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            try:
                signal.signal(signal.SIGINT, self._handle)
                self.previous = handler
            except (ValueError, OSError):  # signals are not this interpreter's to handle
                pass

    def _handle(self, signum, frame):
        if self.deferring:
            self.caught = (signum, frame)
        else:
            self.previous(signum, frame)

    def deliver(self):
        if self.caught is not None:
            caught, self.caught = self.caught, None
            self.previous(*caught)

    def uninstall(self):
        """Puts the previous handler back, unless another has replaced this one since (or this is not the main
        thread: the wrapper then stays, and passes every signal on)."""
        if self.previous is not None and signal.getsignal(signal.SIGINT) == self._handle:
            try:
                signal.signal(signal.SIGINT, self.previous)
                self.previous = None
            except (ValueError, OSError):
                pass
