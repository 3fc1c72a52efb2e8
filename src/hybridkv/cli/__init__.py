"""The ``hybridkv`` command line (``[project.scripts] hybridkv = "hybridkv.cli:main"``).

``app`` (``main``: dispatch, exit codes, signals), ``argtypes`` (argument types), one module per
command: ``replay``, ``sweep``, ``cluster``, ``check_trace``, ``verify``. Library code never
imports this package.
"""

from hybridkv.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
