"""Offline profiler and plan-table compiler (``tessera profile``; DESIGN section 6).

    run_profile(ProfileConfig(out_dir))         # L[case, plan] records in out_dir/profile.jsonl
    profile = load_profile([records])           # complete cases of one architecture and catalog
    table, report = compile_table(profile)      # PlanTable (plan_table.py) + what was learned
    table.save("tessera_diffusers/data/plan_table_sm90.json")

``config``, ``records`` and ``runner`` import torch and the benchmark harness; ``compile`` needs
numpy and scikit-learn (the ``profile`` extra). The online path never imports this package.
"""

from .compile import CompileOptions, CompileReport, Profile, ProfiledCase, compile_table, load_profile
from .config import ProfileConfig, smoke_config
from .runner import KernelTimer, Measured, ProfileSummary, Trial, run_profile

__all__ = [
    "CompileOptions",
    "CompileReport",
    "KernelTimer",
    "Measured",
    "Profile",
    "ProfileConfig",
    "ProfileSummary",
    "ProfiledCase",
    "Trial",
    "compile_table",
    "load_profile",
    "run_profile",
    "smoke_config",
]
