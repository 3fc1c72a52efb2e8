"""``python -m hybridkv.cli``: the ``hybridkv`` command."""

import sys

from hybridkv.cli.app import main

sys.exit(main())
