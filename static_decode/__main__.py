"""`python -m static_decode ...` runs the `static-decode` command line."""

import sys

from static_decode.cli import main

sys.exit(main())
