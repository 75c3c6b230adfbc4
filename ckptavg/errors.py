"""The one exception type that every user-facing failure raises."""


class CkptavgError(Exception):
    """A configuration or input error that the user can fix.

    The message is one line and names the offending value, file or tensor; the CLI prints it
    as ``ckptavg: error: <message>`` and exits 1 without a traceback.
    """
