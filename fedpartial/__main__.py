"""``python -m fedpartial`` is the ``fedpartial`` command."""

import sys

from fedpartial._src.cli.main import main

sys.exit(main())
