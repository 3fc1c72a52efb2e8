"""``python -m hybridkv.cli``: the ``hybridkv`` command."""

import sys

from hybridkv.cli.main import main

sys.exit(main())
