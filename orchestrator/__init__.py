"""ps-compose orchestrator: a typed YAML topology, rendered to a compose file.

`python -m orchestrator render|local ...` (see `orchestrator.cli`).
"""


class UsageError(Exception):
    """Bad input from the user (a flag, a config, a path): exit status 2.

    The message is one line, printed after ``error: `` on stderr.
    """
