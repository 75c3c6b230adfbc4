"""The one exception type that every user-facing failure raises, and its three kinds.

Every message is one line and names the offending value, file or tensor; the CLI prints it as
``ckptavg: error: <message>`` and exits 1 without a traceback. Catch :class:`CkptavgError` for
all of them, or a subclass for one kind.
"""


class CkptavgError(Exception):
    """A configuration or input error that the user can fix."""


class ConfigError(CkptavgError):
    """An option, argument or call that cannot be used as given: a bad ``--window``, an unknown
    dtype, a window with no checkpoint in it, a hook called out of order."""


class CheckpointError(CkptavgError):
    """A checkpoint (or a file the training hook keeps) that cannot be read as what it claims
    to be: malformed, truncated, hostile, or unlike the other sources."""


class OutputError(CkptavgError):
    """An output that cannot be written, published or verified: it exists, it would destroy a
    source, the disk refuses it, or it is not what its manifest says."""
