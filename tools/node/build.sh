#!/usr/bin/env bash
# Builds the node's Kubernetes binaries (kubelet, kube-proxy) from the pinned Go module in
# tools/node/kubernetes, at the control plane's Kubernetes version, into a cache keyed by
# version like tools/controlplane/build.sh:
#   ${INFERGATE_BIN_CACHE:-~/.cache/infergate/bin}/<kubernetes-version>-<pins hash>/{kubelet,kube-proxy}
# Prints that folder's path on its last line. A binary already there is not rebuilt.
# A missing Go toolchain, a version that differs from the control plane's, or a failed
# build exits non-zero with a message.
#
# With --coredns it builds the node's cluster DNS instead, CoreDNS from the Go module pinned
# in tools/node/coredns, into .../coredns-<version>-<pins hash>/coredns, and prints that folder.
#
# Usage: tools/node/build.sh [--print-dir] [--coredns]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

if ! command -v go >/dev/null 2>&1; then
  echo "tools/node/build.sh: no 'go' on PATH: kubelet and kube-proxy are built from source" >&2
  exit 2
fi

version_of() { awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$1"; }
k8s_version="$(version_of "$here/kubernetes/go.mod")"
plane_version="$(version_of "$here/../controlplane/kubernetes/go.mod")"
if [[ "$k8s_version" != "$plane_version" ]]; then
  echo "tools/node/build.sh: tools/node/kubernetes pins k8s.io/kubernetes $k8s_version but the" \
       "control plane pins $plane_version: keep them equal (kubelet version skew)" >&2
  exit 2
fi
pins_hash="$(cat "$here"/kubernetes/go.mod "$here"/kubernetes/go.sum "$here/build.sh" | sha256sum | cut -c1-10)"
cache_root="${INFERGATE_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infergate/bin}"
out="$cache_root/$k8s_version-node-$pins_hash"

coredns_version="$(awk '$1=="github.com/coredns/coredns" {print $2}' "$here/coredns/go.mod")"
coredns_hash="$(cat "$here"/coredns/go.mod "$here"/coredns/go.sum "$here/build.sh" | sha256sum | cut -c1-10)"
coredns_out="$cache_root/coredns-$coredns_version-$coredns_hash"
print_only=0 coredns=0
for arg in "$@"; do
  case "$arg" in
    --print-dir) print_only=1 ;;
    --coredns) coredns=1; out="$coredns_out" ;;
    *) echo "tools/node/build.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
if ((print_only)); then echo "$out"; exit 0; fi

mkdir -p "$out"
# Two cores are the machine's size and others work on them: one package at a time, nice 19.
export GOFLAGS="${GOFLAGS:--p=1} -mod=readonly -trimpath"
export GOMAXPROCS="${GOMAXPROCS:-1}"
# Upstream builds kubelet and kube-proxy statically (CGO_ENABLED=0) too.
export CGO_ENABLED=0
minor="${k8s_version#v1.}"; minor="${minor%%.*}"
stamp="-X k8s.io/component-base/version.gitVersion=$k8s_version"
stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
stamp+=" -X k8s.io/component-base/version.gitTreeState=clean"
stamp+=" -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"
stamp+=" -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
build() {  # build NAME MODULE-FOLDER PACKAGE LDFLAGS
  local name="$1" module="$2" package="$3" ldflags="$4" start
  if [[ -x "$out/$name" ]]; then return 0; fi
  echo "building $name ($package) into $out" >&2
  start=$(date +%s)
  if ! (cd "$here/$module" && nice -n 19 go build -ldflags="$ldflags" -o "$out/$name.tmp" "$package"); then
    rm -f "$out/$name.tmp"
    echo "tools/node/build.sh: building $name failed (see the go output above)" >&2
    exit 1
  fi
  mv "$out/$name.tmp" "$out/$name"
  echo "built $name in $(( $(date +%s) - start ))s ($(du -h "$out/$name" | cut -f1))" >&2
}
if ((coredns)); then
  build coredns coredns github.com/coredns/coredns "-s -w"
else
  for name in kubelet kube-proxy; do
    build "$name" kubernetes "k8s.io/kubernetes/cmd/$name" "-s -w $stamp"
  done
fi
echo "$out"
