"""Diffusers attention processors (installed as tessera_diffusers.processors)."""
