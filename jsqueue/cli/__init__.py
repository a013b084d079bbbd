"""The ``jsqueue`` command line: :mod:`.commands` holds the typer app (parse, load settings,
call), :mod:`.render` the text renderers; :func:`main` is the console script
(``jsqueue = "jsqueue.cli:main"``) and what ``python -m jsqueue`` runs.
"""

from __future__ import annotations

import logging
import sys


def main() -> None:
    """Console-script entry point: run the command line, exit with its code."""
    import jsqueue.cli.tls  # noqa: F401  (registers ``tls-report`` on the app)
    from jsqueue.cli.commands import app
    from jsqueue.cli.mail_commands import register

    register()

    logging.captureWarnings(True)
    app(prog_name="jsqueue")
    sys.exit(0)
