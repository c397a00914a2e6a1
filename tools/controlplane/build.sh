#!/usr/bin/env bash
# Builds the cluster tier's control-plane binaries from the pinned Go modules in this folder
# into a cache keyed by version:
#   ${INFERGATE_BIN_CACHE:-~/.cache/infergate/bin}/<kubernetes-version>/{kube-apiserver,
#   kube-controller-manager,kubectl,etcd,kwok,helm}
# Prints that folder's path on its last line. A binary already there is not rebuilt.
# A missing Go toolchain or a failed build exits non-zero with a message: never a skip.
#
# Usage: tools/controlplane/build.sh [--print-dir] [--timings FILE]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

if ! command -v go >/dev/null 2>&1; then
  echo "tools/controlplane/build.sh: no 'go' on PATH: the cluster tier builds kube-apiserver," \
       "etcd, kubectl, helm and kwok from source and needs Go (see docs/kubernetes.md)" >&2
  exit 2
fi

# The version that keys the cache: k8s.io/kubernetes' pinned version, plus a short hash of
# every go.mod/go.sum here and of this script, so changing any pin or flag rebuilds into a
# new folder.
k8s_version="$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$here/kubernetes/go.mod")"
pins_hash="$(cat "$here"/*/go.mod "$here"/*/go.sum "$here/build.sh" | sha256sum | cut -c1-10)"
cache_root="${INFERGATE_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infergate/bin}"
out="$cache_root/$k8s_version-$pins_hash"

if [[ "${1:-}" == "--print-dir" ]]; then echo "$out"; exit 0; fi
timings=""
if [[ "${1:-}" == "--timings" ]]; then timings="$2"; fi

mkdir -p "$out"
# module dir : package : binary name
targets=(
  "kubernetes:k8s.io/kubernetes/cmd/kube-apiserver:kube-apiserver"
  "kubernetes:k8s.io/kubernetes/cmd/kube-controller-manager:kube-controller-manager"
  "kubernetes:k8s.io/kubernetes/cmd/kube-scheduler:kube-scheduler"
  "kubernetes:k8s.io/kubernetes/cmd/kubectl:kubectl"
  "etcd:go.etcd.io/etcd/server/v3:etcd"
  "kwok:sigs.k8s.io/kwok/cmd/kwok:kwok"
  "helm:helm.sh/helm/v3/cmd/helm:helm"
)
# Two cores are the machine's size: keep the build from starving everything else.
export GOFLAGS="${GOFLAGS:--p=2} -mod=readonly -trimpath"
export CGO_ENABLED=0
# What upstream's release build stamps in with -X: without it the binaries say
# v0.0.0-master and helm refuses charts with a kubeVersion constraint.
minor="${k8s_version#v1.}"; minor="${minor%%.*}"
k8s_stamp="-X k8s.io/component-base/version.gitVersion=$k8s_version"
k8s_stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
k8s_stamp+=" -X k8s.io/component-base/version.gitTreeState=clean"
k8s_stamp+=" -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"
k8s_stamp+=" -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
for t in "${targets[@]}"; do
  IFS=: read -r mod pkg name <<<"$t"
  if [[ -x "$out/$name" ]]; then continue; fi
  ldflags="-s -w"
  if [[ "$mod" == "kubernetes" ]]; then ldflags+=" $k8s_stamp"; fi
  echo "building $name ($pkg) into $out" >&2
  start=$(date +%s)
  if ! (cd "$here/$mod" && nice -n 19 go build -ldflags="$ldflags" -o "$out/$name.tmp" "$pkg"); then
    rm -f "$out/$name.tmp"
    echo "tools/controlplane/build.sh: building $name failed (see the go output above)" >&2
    exit 1
  fi
  mv "$out/$name.tmp" "$out/$name"
  secs=$(( $(date +%s) - start ))
  echo "built $name in ${secs}s ($(du -h "$out/$name" | cut -f1))" >&2
  if [[ -n "$timings" ]]; then echo "$name $secs $(stat -c %s "$out/$name")" >>"$timings"; fi
done
echo "$out"
