"""``python -m tessera_diffusers.bench``: the ``tessera bench`` command."""

from .cli import main

raise SystemExit(main())
