"""`python -m jaxformer ...` is the `jaxformer` command (see `jaxformer.cli.main`)."""

import sys

from jaxformer.cli.main import main

sys.exit(main())
