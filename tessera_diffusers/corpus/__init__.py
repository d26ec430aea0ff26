"""The mask corpus: ten families of video-like block masks from six sparsifier imitations.

    from tessera_diffusers.corpus import enumerate_cases, CaseSpec, WAN_720P

    for case in enumerate_cases("evaluation", families=["Q64K64"]):   # lazy, >= 2,000 in all
        mask = case.build("cuda")                                       # LogicalMask [1, H, nQ, nKV]

    save_corpus("corpus_dir", [(case, mask)]);  entries = load_corpus("corpus_dir", "cuda")

Families (``FAMILIES``): Q16K16, Q32K16, Q32K32, Q64K32, Q64K64-HD (4-6%), Q64K64 (9-12%),
Q64K64-DD (18-22%), Q128K64, Q128K128 (9-12% unless noted), and HunyuanVideo-1.5's native Q384K384
(12-22%, SSTA tiles). Sources (``ALL_SOURCES``): sliding_tile, temporal_heads, importance_topk,
clustered_permuted, text_sink (every family but Q384K384) and ssta (Q384K384). Grids (``GRIDS``):
Wan2.1 720p/480p, HunyuanVideo-1.5 720p/480p (with 1,985 text tokens) and a 32,768-token grid.

``DEFAULTS_FAMILIES`` (outside ``FAMILIES``): the masks the one-liner's default sparsifiers make at
the models' own sizes, Q384K384-W (Wan2.1, 6-16%) and Q384K384-H (HunyuanVideo-1.5 video tokens,
``VIDEO_ONLY_GRIDS``, 12-50%), from the product's sparsifier code (source ``tessera_default``); the
plan table's model-size buckets are profiled on them.
"""

from .cases import (
    SEED_CHUNK,
    SEEDS_PER_COMBO,
    SPLITS,
    CaseSpec,
    combinations,
    count_cases,
    enumerate_cases,
    split_of,
    split_seeds,
)
from .families import (
    ALL_SOURCES,
    DEFAULTS_FAMILIES,
    DEFAULTS_SOURCE,
    FAMILIES,
    NINE_FAMILIES,
    SSTA_SOURCE,
    VIDEO_SOURCES,
    MaskFamily,
    family_named,
)
from .grids import (
    BENCH_32K,
    GRIDS,
    HV_480P,
    HV_480P_VIDEO,
    HV_720P,
    HV_720P_VIDEO,
    VIDEO_ONLY_GRIDS,
    WAN_480P,
    WAN_720P,
    LatentGrid,
    TokenLayout,
    grid_named,
)
from .storage import CorpusEntry, iter_corpus, load_corpus, save_corpus

__all__ = [
    "ALL_SOURCES",
    "BENCH_32K",
    "DEFAULTS_FAMILIES",
    "DEFAULTS_SOURCE",
    "FAMILIES",
    "GRIDS",
    "HV_480P",
    "HV_480P_VIDEO",
    "HV_720P",
    "HV_720P_VIDEO",
    "NINE_FAMILIES",
    "SEEDS_PER_COMBO",
    "SEED_CHUNK",
    "SPLITS",
    "SSTA_SOURCE",
    "VIDEO_ONLY_GRIDS",
    "VIDEO_SOURCES",
    "WAN_480P",
    "WAN_720P",
    "CaseSpec",
    "CorpusEntry",
    "LatentGrid",
    "MaskFamily",
    "TokenLayout",
    "combinations",
    "count_cases",
    "enumerate_cases",
    "family_named",
    "grid_named",
    "iter_corpus",
    "load_corpus",
    "save_corpus",
    "split_of",
    "split_seeds",
]
