#!/usr/bin/env bash
# The conformance suite on the real node (`sudo make conformance-node`): conformance/kind.sh's
# steps with the node of tools/node/probe.sh instead of kind.
#
#   1. probe.sh up: control plane, containerd, runc, CNI, kubelet, kube-proxy, CoreDNS in
#      the network namespace infergate-node (torn down on exit, as on failure);
#   2. images into containerd, no registry: make images' operator and EPP layouts (the EPP
#      also as ghcr.io/infergate/epp:conformance, the name the suite's manifests use), and
#      the echo server (conformance/echo/server.py with its h2 packages from this venv, on
#      the EPP image's Python: buildah, as infergate/conformance-echo:dev);
#   3. helm install of charts/infergate as kind.sh does (Gateway controller on, Endpoint
#      Pickers the suite's, Gateway Services ClusterIP), the Envoy image the node's;
#   4. pytest conformance --conformance-driver=node inside the namespace.
#
# Needs root, `sudo make images IMAGES="operator epp"` done, and what probe.sh needs.
# Environment: PYTEST_ARGS (extra pytest arguments), CONFORMANCE_REPORT (report path).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
W="${INFERGATE_NODE_WORKDIR:-/var/tmp/infergate-node}"
images="${INFERGATE_IMAGES_OUT:-$repo/build/images}"
ECHO_IMAGE="docker.io/infergate/conformance-echo:dev"

die() { echo "tools/node/conformance.sh: $*" >&2; exit 1; }
[[ $EUID -eq 0 ]] || die "run as root (the node needs it)"
for name in operator epp; do
  [[ -f "$images/$name/oci-layout" ]] || die "image $name not built: sudo make images IMAGES=\"operator epp\""
done

bash "$here/probe.sh" up
trap 'bash "$here/probe.sh" down' EXIT
# shellcheck disable=SC1091
source "$W/node.env"   # NETNS, KUBECONFIG, CONTAINERD_SOCKET, TOOLS, ENVOY_IMAGE
export KUBECONFIG  # node.env only assigns it; helm and kubectl read it from the environment
ctr=(ctr --address "$CONTAINERD_SOCKET" -n k8s.io)

import_layout() {  # import_layout NAME: build/images/NAME as ghcr.io/infergate/NAME:<its tag>
  tar -C "$images/$1" -cf - . | "${ctr[@]}" images import --base-name "ghcr.io/infergate/$1" - >&2
}
import_layout operator
import_layout epp
tag="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])' "$images/epp/index.json")"
"${ctr[@]}" images tag --force "ghcr.io/infergate/epp:$tag" ghcr.io/infergate/epp:conformance >&2

# The echo server: conformance/echo/Dockerfile's python:3.11-slim + h2, on the EPP image's
# Python instead (no registry here); h2 and its two dependencies are pure Python.
b=(buildah --root "$W/buildah/root" --runroot "$W/buildah/run" --storage-driver vfs)
site="$("$repo/.venv/bin/python" -c 'import h2, os; print(os.path.dirname(os.path.dirname(h2.__file__)))')"
rootfs="$W/images/echo-rootfs"
mkdir -p "$rootfs/app/lib"
cp conformance/echo/server.py "$rootfs/app/server.py"
for package in h2 hpack hyperframe; do cp -r "$site/$package" "$rootfs/app/lib/"; done
c="$("${b[@]}" from "oci:$images/epp")"
"${b[@]}" copy "$c" "$rootfs" / >/dev/null
"${b[@]}" config --entrypoint '["/opt/infergate/bin/python", "/app/server.py"]' --cmd '[]' \
  --env PYTHONPATH=/app/lib --user 65532:65532 "$c"
"${b[@]}" commit -q --format oci "$c" "oci-archive:$W/images/echo.tar:$ECHO_IMAGE" >/dev/null
"${ctr[@]}" images import "$W/images/echo.tar" >&2

"$TOOLS/helm" install infergate charts/infergate --namespace infergate-system --create-namespace \
  --set "epp.envoyImage=$ENVOY_IMAGE" --set gateway.enabled=true \
  --set gateway.serviceType=ClusterIP --set operator.manageEndpointPickers=false \
  --set operator.resources.requests.cpu=300m --wait --timeout 5m

report="${CONFORMANCE_REPORT:-$repo/conformance/reports/node/infergate-node-gateway-report.yaml}"
mkdir -p "$(dirname "$report")"
# shellcheck disable=SC2086 # PYTEST_ARGS is word-split on purpose
nsenter --net="$NETNS" -- env KUBECONFIG="$KUBECONFIG" INFERGATE_NODE_WORKDIR="$W" \
  "$repo/.venv/bin/pytest" conformance -m conformance -p no:cacheprovider \
  --conformance-driver=node --gateway-class=infergate --conformance-report="$report" \
  ${PYTEST_ARGS:-}
