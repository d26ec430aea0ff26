"""``python -m tessera_diffusers.profile``: the ``tessera profile`` command."""

from .cli import main

raise SystemExit(main())
