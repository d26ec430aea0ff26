"""The README's main job, as a script: same as ``tessera demo`` (see tessera_diffusers/demo.py)."""

from tessera_diffusers.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
