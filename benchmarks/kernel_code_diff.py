"""Compare the machine code of two builds of the native kernels, kernel by kernel (CPU; no GPU needed).

A change to kernel sources that should not change what runs (a refactor, a comment, a new switch
whose default keeps the old path) can be checked here without a device: every ``.text.<kernel>``
section of the cubins embedded in each input (a ``libtessera_kernels.so`` or the objects of a build
directory) is hashed and the two sides are compared by kernel name. Line information and other
sections are left out, so moved source lines do not count as a change.

    python benchmarks/kernel_code_diff.py OLD/libtessera_kernels.so NEW/libtessera_kernels.so
    python benchmarks/kernel_code_diff.py OLD_BUILD_DIR NEW_BUILD_DIR --only hopper_

Needs ``objcopy`` (binutils). Exit status 0 when every kernel of both sides has the same code, 1
otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ELF_MAGIC = b"\x7fELF"


def embedded_cubins(path: Path) -> list[bytes]:
    """The ELF images in the ``.nv_fatbin`` section of a host object or shared library."""
    if shutil.which("objcopy") is None:
        raise SystemExit("kernel_code_diff: objcopy (binutils) is needed to read the embedded cubins")
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "fatbin"
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", str(path), str(blob)], check=True)
        data = blob.read_bytes() if blob.exists() else b""
    return split_images(data)


def split_images(data: bytes) -> list[bytes]:
    """Every ELF image in a fatbin blob, each from its header on (section offsets count from there)."""
    images, at = [], data.find(ELF_MAGIC)
    while at >= 0:
        images.append(data[at:])
        at = data.find(ELF_MAGIC, at + len(ELF_MAGIC))
    return images


def kernel_text_hashes(image: bytes) -> dict[str, str]:
    """sha256 of every ``.text.<kernel>`` section of one 64-bit little-endian cubin."""
    if image[4] != 2 or image[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + k * shentsize) for k in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        start = names_at + name_off
        name = image[start:image.index(b"\0", start)].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = hashlib.sha256(image[offset:offset + size]).hexdigest()
    return out


def kernels_of(path: Path, only: str) -> dict[str, str]:
    """Kernel name -> code hash over a library or every ``*.o`` of a build directory."""
    files = sorted(path.glob("*.o")) if path.is_dir() else [path]
    files = [f for f in files if only in f.name] if path.is_dir() else files
    if not files:
        raise SystemExit(f"kernel_code_diff: no objects in {path} (expected a library or a build directory of *.o)")
    out: dict[str, str] = {}
    for f in files:
        images = embedded_cubins(f)
        if not images:
            raise SystemExit(f"kernel_code_diff: {f} has no uncompressed cubin in .nv_fatbin (built with compression?)")
        for image in images:
            for name, digest in kernel_text_hashes(image).items():
                out[f"{name} [{f.name}]" if path.is_dir() and name in out else name] = digest
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--only", default="", help="build directories: only objects whose name contains this")
    args = ap.parse_args(argv)
    old, new = kernels_of(args.old, args.only), kernels_of(args.new, args.only)
    same = sorted(k for k in old.keys() & new.keys() if old[k] == new[k])
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    for label, names in (("changed", changed), ("only in old", gone), ("only in new", added)):
        for name in names:
            print(f"{label}: {name}")
    print(f"{len(same)} kernels with the same code, {len(changed)} changed, {len(gone)} only in old, "
          f"{len(added)} only in new")
    return 0 if not (changed or gone or added) else 1


if __name__ == "__main__":
    sys.exit(main())
