"""Entry point: ``python -m builder`` (see builder/cli.py)."""
import sys

from builder.cli import main

sys.exit(main())
