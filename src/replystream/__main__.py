"""``python -m replystream`` runs the command-line interface."""

import sys

try:
    from replystream.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line's own modules load
    sys.exit(130)  # 128 + SIGINT: cli.INTERRUPTED_EXIT, which could not be read yet

sys.exit(main())
