"""`python -m jaxformer ...` is the `jaxformer` command (see `jaxformer.cli`)."""

import sys

from jaxformer.cli import main

sys.exit(main())
