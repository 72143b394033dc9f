"""`python -m daemon`: the same as `molt daemon`."""
import sys

from . import cli_main

sys.exit(cli_main())
