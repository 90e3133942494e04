"""``python -m fedpartial`` is the ``fedpartial`` command."""

import sys

from fedpartial.cli import main

sys.exit(main())
