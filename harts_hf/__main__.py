"""``python -m harts_hf``: the same as the ``harts-hf`` console script."""

from .app.cli import main

raise SystemExit(main())
