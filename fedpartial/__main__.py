"""``python -m fedpartial`` is the ``fedpartial`` command."""

from fedpartial._src.cli.entry import console

console()
