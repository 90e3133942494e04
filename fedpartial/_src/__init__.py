"""fedpartial's implementation, one package per layer (private: import from ``fedpartial``,
``fedpartial.methods``, ``fedpartial.models`` and ``fedpartial.data``).

Dependencies point one way, enforced by the import-linter contracts in ``pyproject.toml``::

    cli → analysis | bench → experiment → methods → costs → engine → models | data → core
"""
