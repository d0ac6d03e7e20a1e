#!/usr/bin/env bash
# .variant/ for primitives_ab.py: the asyncgpu package of the cpython-prims branch (git
# archive), with that branch's C extension as its worktree built it.
#   bash benchmarks/diagnostics/make_variant.sh [BRANCH] [PATH/TO/_native.abi3.so]
# Without a .so path, the one in the branch's git worktree is taken, if that worktree's
# _native.c is the branch's committed one and the .so is newer than it. Build both the way
# pip builds them, so that they are compiled alike: here `pip install -e .`; in the
# branch's worktree `pip wheel --no-deps . -w DIR` and the .so unzipped from the wheel
# into its asyncgpu/. .variant/REVISION records the branch's commit.
set -euo pipefail
cd "$(dirname "$0")/../.."
branch=${1:-cpython-prims}
so=${2:-}
rev=$(git rev-parse --verify "$branch^{commit}")
if [ -z "$so" ]; then
  wt=$(git worktree list --porcelain |
    awk -v b="branch refs/heads/$branch" '/^worktree /{w=substr($0, 10)} $0 == b {print w}')
  if [ -z "$wt" ]; then
    echo "make_variant.sh: no worktree has $branch checked out; pass the .so's path" >&2
    exit 2
  fi
  if ! git -C "$wt" diff --quiet "$rev" -- asyncgpu/_native.c; then
    echo "make_variant.sh: $wt/asyncgpu/_native.c differs from $branch's ($rev)" >&2
    exit 2
  fi
  so=$wt/asyncgpu/_native.abi3.so
  if [ ! "$so" -nt "$wt/asyncgpu/_native.c" ]; then
    echo "make_variant.sh: $so is missing or older than its source: build it there first" >&2
    exit 2
  fi
fi
rm -rf .variant
mkdir .variant
git archive "$rev" asyncgpu | tar -x -C .variant
cp "$so" .variant/asyncgpu/_native.abi3.so
echo "$rev" > .variant/REVISION
echo "made .variant/ from $branch ($rev) with $so"
