"""`python -m static_decode ...` runs the `static-decode` command line."""

import sys

from static_decode.commands.cli import main

sys.exit(main())
