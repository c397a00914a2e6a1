#!/usr/bin/env bash
# The InferencePool conformance suite on a throw-away kind cluster (`make conformance`).
#
# Creates a kind cluster, builds and loads the operator, EPP and echo images,
# `helm install`s charts/infergate (its CRDs, the Gateway API CRDs, GatewayClass
# `infergate`, the operator as the Gateway controller; Endpoint Pickers are the suite's,
# as GIE deploys its own), runs the suite with the cluster driver, writes the report in
# GIE's format under conformance/reports/kind/, and deletes the cluster.
#
# Needs: docker (with a running engine), kind, kubectl, helm, and this checkout's .venv
# (make install). The Gateways' Envoy image is pulled by the cluster. Every step prints
# what it does.
#
# Environment knobs:
#   CLUSTER_NAME (infergate-conformance)  KEEP_CLUSTER=1 (do not delete it at the end)
#   KIND_NODE_IMAGE (pinned below)
#   PYTEST_ARGS (extra pytest arguments, e.g. "-k routing -x")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER_NAME="${CLUSTER_NAME:-infergate-conformance}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.33.1}"
TAG="${TAG:-conformance}"
OPERATOR_IMAGE="ghcr.io/infergate/operator:${TAG}"
EPP_IMAGE="ghcr.io/infergate/epp:${TAG}"
ECHO_IMAGE="infergate/conformance-echo:dev"   # the name conformance/manifests/base.yaml uses
REPORT_DIR="conformance/reports/kind"
WORKDIR="$(mktemp -d -t infergate-conformance.XXXXXX)"
export KUBECONFIG="$WORKDIR/kubeconfig"

step() { printf '\n==> %s\n' "$*"; }
run() { printf '    $ %s\n' "$*"; "$@"; }
die() { printf '\nconformance/kind.sh: %s\n' "$*" >&2; exit 1; }

need() {
    local tool="$1" hint="$2"
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed or not on PATH. $hint"
}

step "Checking the tools"
need docker "Install Docker: https://docs.docker.com/engine/install/"
docker info >/dev/null 2>&1 || die "'docker' is installed but no Docker engine answers (is the daemon running? can this user reach it?)"
need kind "Install kind v0.29+: https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "Install kubectl: https://kubernetes.io/docs/tasks/tools/"
need helm "Install Helm 3: https://helm.sh/docs/intro/install/"
[ -x .venv/bin/pytest ] || die "'.venv/bin/pytest' is missing: run 'make install' first"

cleanup() {
    local code=$?
    if [ "${KEEP_CLUSTER:-0}" = "1" ]; then
        step "Keeping cluster ${CLUSTER_NAME} (KEEP_CLUSTER=1); KUBECONFIG=${KUBECONFIG}"
    else
        step "Deleting cluster ${CLUSTER_NAME}"
        kind delete cluster --name "$CLUSTER_NAME" || true
        rm -rf "$WORKDIR"
    fi
    exit "$code"
}

step "Creating kind cluster ${CLUSTER_NAME} (${KIND_NODE_IMAGE})"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
    die "a kind cluster named ${CLUSTER_NAME} already exists; delete it (kind delete cluster --name ${CLUSTER_NAME}) or set CLUSTER_NAME"
fi
trap cleanup EXIT
run kind create cluster --name "$CLUSTER_NAME" --image "$KIND_NODE_IMAGE" --kubeconfig "$KUBECONFIG" --wait 120s

step "Building images"
run docker build -f docker/operator.Dockerfile -t "$OPERATOR_IMAGE" .
run docker build -f docker/epp.Dockerfile -t "$EPP_IMAGE" .
run docker build -t "$ECHO_IMAGE" conformance/echo

step "Loading images into the cluster"
for image in "$OPERATOR_IMAGE" "$EPP_IMAGE" "$ECHO_IMAGE"; do
    run kind load docker-image "$image" --name "$CLUSTER_NAME"
done

step "Installing infergate (charts/infergate: CRDs, Gateway API CRDs, GatewayClass infergate, operator)"
# Gateway Services are ClusterIP: kind has no load balancer; the driver port-forwards.
run helm install infergate charts/infergate \
    --namespace infergate-system --create-namespace \
    --set operator.image.repository="${OPERATOR_IMAGE%:*}" --set operator.image.tag="$TAG" \
    --set epp.image.repository="${EPP_IMAGE%:*}" --set epp.image.tag="$TAG" \
    --set gateway.enabled=true --set gateway.serviceType=ClusterIP \
    --set operator.manageEndpointPickers=false \
    --wait --timeout 5m

step "Running the conformance suite (cluster driver)"
mkdir -p "$REPORT_DIR"
REPORT="${REPORT_DIR}/infergate-external-epp-gateway-report.yaml"
# shellcheck disable=SC2086 # PYTEST_ARGS is word-split on purpose
run .venv/bin/pytest conformance -m conformance -p no:cacheprovider \
    --conformance-driver=cluster --gateway-class=infergate \
    --conformance-report="$REPORT" ${PYTEST_ARGS:-}
if [ -f "$REPORT" ]; then
    step "Report written to ${REPORT}"
else
    step "No report written (no conformance test ran)"
fi
