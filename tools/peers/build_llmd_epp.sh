#!/usr/bin/env bash
# Builds llm-d-router's Go Endpoint Picker (`epp`), the peer that the routing lab
# (`--router external-epp --external-epp BIN`) and benchmarks/epp_overhead.py
# (`--peer-binary BIN`) compare infergate against. The repo does not ship the peer, and
# this script does not download its source. SNAPSHOT is a copy of the llm-d/llm-d-router
# repository you already have: a `git clone`, where the network allows one, or the bare
# git directory that a mirror or snapshot tool produced (for example
# /work/.mirror/llm-d+llm-d-router/repo). Go modules come from GOPROXY (the Go module
# proxy by default) or from a module cache that is already filled.
#
# Usage: tools/peers/build_llmd_epp.sh SNAPSHOT [OUT]
#   SNAPSHOT  a git directory (bare or not) holding --commit, or a source tree (its
#             commit is then only what --commit says)
#   OUT       the binary to write (default ~/.cache/infergate/peers/llm-d-epp-<short commit>)
# Options (before SNAPSHOT):
#   --commit SHA  the commit to build (default: the snapshot every figure in
#                 docs/benchmarks/ was measured on)
#   --src DIR     where the source tree goes (default: OUT.src, removed and re-exported)
#   --jobs N      GOMAXPROCS and `go build -p` (default 1: the machine is shared)
#
# The build matches upstream's Dockerfile.epp: CGO_ENABLED=0 (the EPP needs no cgo, and
# with it off no C toolchain or tokenizer library is linked), `-s -w`, and the commit
# stamped into version.CommitSHA. `-trimpath`, `-buildvcs=false` and `-mod=readonly`
# (go.sum must already cover every module) make the same commit and Go version give the
# same bytes. GOTOOLCHAIN=local keeps Go from downloading another toolchain.
# Prints the binary's path on its last line. Any failure exits non-zero with a message.
set -euo pipefail

DEFAULT_COMMIT=ebab687927f5331c1b39defcb579a07951bce56c
commit="$DEFAULT_COMMIT"
commit_given=0
src=""
jobs=1
die() { echo "build_llmd_epp.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --commit) commit="${2:?--commit needs a SHA}"; commit_given=1; shift 2 ;;
    --src) src="${2:?--src needs a directory}"; shift 2 ;;
    --jobs) jobs="${2:?--jobs needs a number}"; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ $# -ge 1 && $# -le 2 ]] || die "usage: build_llmd_epp.sh [--commit SHA] [--src DIR] [--jobs N] SNAPSHOT [OUT]"
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer, not '$jobs'"
snapshot="$1"
[[ -d "$snapshot" ]] || die "snapshot '$snapshot' is not a directory (a clone or bare git dir of llm-d/llm-d-router)"
command -v go >/dev/null 2>&1 || die "no 'go' on PATH: the peer needs Go >= the go.mod's version (1.26.x)"

# A git directory (bare: has HEAD and objects/; a checkout: has .git) is exported at
# --commit; anything else is taken as a source tree as it is.
git_dir=""
if [[ -d "$snapshot/.git" ]]; then git_dir="$snapshot/.git"
elif [[ -f "$snapshot/HEAD" && -d "$snapshot/objects" ]]; then git_dir="$snapshot"; fi
if [[ -n "$git_dir" ]]; then
  resolved="$(git --git-dir="$git_dir" rev-parse --verify --quiet "$commit^{commit}")" \
    || die "snapshot $snapshot does not hold commit $commit (fetch a newer snapshot, or pass --commit)"
  commit="$resolved"
elif [[ "$commit_given" == 0 ]]; then
  commit="unknown"
fi
short="${commit:0:7}"
out="${2:-${XDG_CACHE_HOME:-$HOME/.cache}/infergate/peers/llm-d-epp-$short}"
src="${src:-$out.src}"

if [[ -n "$git_dir" ]]; then
  # Never delete a folder that is not an earlier export: --src may be mistyped.
  if [[ -n "$(ls -A "$src" 2>/dev/null)" ]] \
     && ! grep -qs '^module github.com/llm-d/llm-d-router$' "$src/go.mod"; then
    die "--src $src exists and is not an llm-d-router tree: refusing to replace it"
  fi
  rm -rf "$src"; mkdir -p "$src"
  git --git-dir="$git_dir" archive "$commit" | tar -x -C "$src"
else
  src="$snapshot"
fi
[[ -f "$src/go.mod" && -d "$src/cmd/epp" ]] \
  || die "$src has no go.mod and cmd/epp: not an llm-d-router source tree"
grep -q '^module github.com/llm-d/llm-d-router$' "$src/go.mod" \
  || die "$src/go.mod is not module github.com/llm-d/llm-d-router"

export CGO_ENABLED=0 GOTOOLCHAIN=local GOMAXPROCS="$jobs" GOFLAGS="-mod=readonly -buildvcs=false"
mkdir -p "$(dirname "$out")"
echo "building llm-d-router epp at $commit from $src with $(go version | cut -d' ' -f3), -p $jobs" >&2
start=$(date +%s)
if ! (cd "$src" && nice -n 19 go build -p "$jobs" -trimpath \
        -ldflags "-s -w -X github.com/llm-d/llm-d-router/version.CommitSHA=$commit" \
        -o "$out.tmp" ./cmd/epp); then
  rm -f "$out.tmp"
  die "go build failed (see the go output above)"
fi
mv "$out.tmp" "$out"
echo "built $out in $(( $(date +%s) - start ))s, $(du -h "$out" | cut -f1)," \
     "sha256 $(sha256sum "$out" | cut -c1-16)" >&2
echo "$out"
