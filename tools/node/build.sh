#!/usr/bin/env bash
# Builds the node's Kubernetes binaries (kubelet, kube-proxy) from the pinned Go module in
# tools/node/kubernetes, at the control plane's Kubernetes version, into a cache keyed by
# version like tools/controlplane/build.sh:
#   ${INFERGATE_BIN_CACHE:-~/.cache/infergate/bin}/<kubernetes-version>-<pins hash>/{kubelet,kube-proxy}
# Prints that folder's path on its last line. A binary already there is not rebuilt.
# A missing Go toolchain, a version that differs from the control plane's, or a failed
# build exits non-zero with a message.
#
# Usage: tools/node/build.sh [--print-dir]
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

if [[ "${1:-}" == "--print-dir" ]]; then echo "$out"; exit 0; fi

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
for name in kubelet kube-proxy; do
  if [[ -x "$out/$name" ]]; then continue; fi
  echo "building $name (k8s.io/kubernetes/cmd/$name $k8s_version) into $out" >&2
  start=$(date +%s)
  if ! (cd "$here/kubernetes" && nice -n 19 go build -ldflags="-s -w $stamp" \
          -o "$out/$name.tmp" "k8s.io/kubernetes/cmd/$name"); then
    rm -f "$out/$name.tmp"
    echo "tools/node/build.sh: building $name failed (see the go output above)" >&2
    exit 1
  fi
  mv "$out/$name.tmp" "$out/$name"
  echo "built $name in $(( $(date +%s) - start ))s ($(du -h "$out/$name" | cut -f1))" >&2
done
echo "$out"
