#!/usr/bin/env bash
# Does one call to the GPU machine fit? A call carries the working tree (tracked files and the
# untracked files git does not ignore) plus the ignored paths it names, 64 MiB in all; gpu-check
# needs only the kit beside the tree. Prints each part in MiB; exits 1 when they pass the cap (or
# the kit is missing).
#   usage: scripts/check-carry-size.sh [KIT]   (default target-gpu/gpu-kit.tar.xz)
#   BELLOWS_CARRY_CAP_MIB: the cap (default 64).
set -euo pipefail
cd "$(dirname "$0")/.."
kit="${1:-target-gpu/gpu-kit.tar.xz}"
cap="${BELLOWS_CARRY_CAP_MIB:-64}"
[[ -f "$kit" ]] || {
    echo "[carry-size] no kit at $kit: run scripts/build-cuda.sh --pack" >&2
    exit 1
}
git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
kit, cap = sys.argv[1], float(sys.argv[2])
paths = [p for p in sys.stdin.buffer.read().decode().split("\0") if p]
# A deleted tracked file does not travel; a link travels as a link.
tree = sum(os.lstat(p).st_size for p in paths if os.path.lexists(p))
kit_bytes, mib = os.path.getsize(kit), 1 << 20
total = tree + kit_bytes
print(f"[carry-size] kit {kit_bytes / mib:.2f} MiB + tree {tree / mib:.2f} MiB ({len(paths)} files)"
      f" = {total / mib:.2f} MiB of {cap:g} MiB", file=sys.stderr)
if total > cap * mib:
    sys.exit(f"[carry-size] over the cap by {(total - cap * mib) / mib:.2f} MiB: a device call cannot carry it")
' "$kit" "$cap"
