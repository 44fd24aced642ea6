"""``python -m app.cli``: the same as the ``imageops`` console script."""

from app.cli import main

main()
