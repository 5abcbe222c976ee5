"""``python -m fxplan`` runs the command-line interface."""

from fxplan.cli import main

raise SystemExit(main())
