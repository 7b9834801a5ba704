"""``python -m cuep info | compile``: see cuep/cli.py."""

from .cli import main

raise SystemExit(main())
