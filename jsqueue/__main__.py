"""``python -m jsqueue`` runs the command line."""

from jsqueue.cli import main

main()
