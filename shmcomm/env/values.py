# SPDX-License-Identifier: Apache-2.0
"""How one setting is read and checked, for shmcomm/env/ (which says which settings there are): each SHMCOMM_* name also
under its HOROVOD_* spelling, numbers within their range, Horovod's on/off words; a bad value raises ValueError naming
the variable."""
import contextlib
import os


_overrides = {}  # this process's settings that replace the environment's (env.adopt_identity)
_source = [None]  # the mapping read instead of os.environ inside reading_from(), else None


@contextlib.contextmanager
def reading_from(environ):
    """Inside the block, settings are read from `environ` (a rank's environment, which the launcher checks before it
    starts ranks) instead of this process's."""
    _source[0] = environ
    try:
        yield
    finally:
        _source[0] = None


def _environ():
    return os.environ if _source[0] is None else _source[0]


def set_overrides(values):
    """{name: text} read from here on instead of the environment's SHMCOMM_name/HOROVOD_name."""
    _overrides.update(values)


def get(name, default=None, environ=None):
    if environ is None:
        if name in _overrides:
            return _overrides[name]
        environ = _environ()
    for prefix in ("SHMCOMM_", "HOROVOD_"):
        value = environ.get(prefix + name)
        if value not in (None, ""):
            return value
    return default


def spelling(name, environ=None):
    """The variable that gives the setting its value, as the user wrote it: SHMCOMM_name or HOROVOD_name."""
    environ = _environ() if environ is None else environ
    return next((p + name for p in ("SHMCOMM_", "HOROVOD_") if environ.get(p + name) not in (None, "")),
                "SHMCOMM_" + name)


try:
    from shmcomm._native import lib as _core
    MAX_BYTES = _core.SMC_MAX_BYTES      # no buffer is larger than the address space
    MAX_SECONDS = _core.SMC_MAX_SECONDS  # the longest wait
except ImportError:  # no core built: the launcher still reads settings, and its --check-build says what is missing
    MAX_BYTES = MAX_SECONDS = float("inf")


def number(name, default, kind=float, environ=None, low=None, high=None, positive=False):
    """The setting as a number of `kind`, at least `low` (above 0 if `positive`) and at most `high`; a value
    that is not such a number (NaN, infinite, negative where that means nothing) raises ValueError naming it."""
    value = get(name, environ=environ)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise ValueError("environment variable %s=%r is not a valid %s" % (spelling(name, environ), value,
                                                                           kind.__name__))
    if number != number or (low is not None and number < low) or (high is not None and number > high) or \
            (positive and not number > 0):
        raise ValueError("environment variable %s=%r is out of range: expected %s" % (
            spelling(name, environ), value, _range_text(kind, low, high, positive)))
    return number


def _range_text(kind, low, high, positive):
    what = "an integer" if kind is int else "a number"
    if positive:
        what += " above 0"
    elif low is not None:
        what += " of at least %s" % low
    return what + (" and at most %g" % high if high is not None else "")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(name, default=False, environ=None):
    """A yes/no setting (switch), `default` when unset."""
    value = switch(name, environ)
    return default if value is None else value


def switch(name, environ=None):
    """A Horovod on/off variable: None when unset, else True (1/true/yes/on, any case) or False (0/false/no/off);
    anything else raises ValueError naming it."""
    value = get(name, environ=environ)
    if value is None:
        return None
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError("environment variable %s=%r: expected 1 or 0 (true/false, yes/no, on/off)"
                     % (spelling(name, environ), value))


def is_set(name, environ=None):
    return get(name, environ=environ) is not None
