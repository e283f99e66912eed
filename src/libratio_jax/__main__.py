import sys

from libratio_jax.cli import main

sys.exit(main())
