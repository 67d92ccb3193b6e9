#!/usr/bin/env bash
# The "before" folder of h200_run.sh's profile-ab / profile-abs parts: DIR/<path> holds <path> as it was at BASE.
#   bash benchmarks/ab_folder.sh DIR BASE PATH...     the paths given
#   bash benchmarks/ab_folder.sh DIR BASE COMMIT      every file changed from BASE to COMMIT (e.g. ab-mla X~1 X)
# A file that did not exist at BASE is left out (profile_ab keeps the tree's copy). The folder is untracked, so it
# travels with a device call; delete it afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: $0 DIR BASE (PATH... | COMMIT)" >&2; exit 2; }
dir=$1 base=$2
shift 2
if [ $# -eq 1 ] && [ ! -e "$1" ] && git rev-parse -q --verify "$1^{commit}" >/dev/null; then
  mapfile -t paths < <(git diff --name-only "$base" "$1")
  set -- "${paths[@]}"
fi
for f in "$@"; do
  if git cat-file -e "$base:$f" 2>/dev/null; then
    mkdir -p "$dir/$(dirname "$f")"
    git show "$base:$f" >"$dir/$f"
    echo "$dir/$f"
  else
    echo "left out: $f (not at $base)"
  fi
done
