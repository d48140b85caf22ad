"""``python -m replystream`` runs the command-line interface."""

import sys

from replystream.cli import main

sys.exit(main())
