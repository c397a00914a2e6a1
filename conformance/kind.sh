#!/usr/bin/env bash
# The InferencePool conformance suite on a throw-away kind cluster (`make conformance`).
#
# Creates a kind cluster, builds and loads the operator, EPP and echo images, installs
# the Gateway API CRDs and Istio (a Gateway API implementation with InferencePool
# support), `helm install`s charts/infergate, runs the suite with the cluster driver,
# writes a GIE-shaped report under conformance/reports/, and deletes the cluster.
#
# Needs: docker (with a running engine), kind, kubectl, helm, istioctl, and this
# checkout's .venv (make install). Every step prints what it does.
#
# Environment knobs:
#   CLUSTER_NAME (infergate-conformance)  KEEP_CLUSTER=1 (do not delete it at the end)
#   KIND_NODE_IMAGE, GATEWAY_API_VERSION, ISTIO_VERSION (pinned below)
#   PYTEST_ARGS (extra pytest arguments, e.g. "-k routing -x")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER_NAME="${CLUSTER_NAME:-infergate-conformance}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.33.1}"
GATEWAY_API_VERSION="${GATEWAY_API_VERSION:-v1.5.1}"
ISTIO_VERSION="${ISTIO_VERSION:-1.30.1}"
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
need istioctl "Install istioctl ${ISTIO_VERSION}: curl -L https://istio.io/downloadIstio | ISTIO_VERSION=${ISTIO_VERSION} sh -"
[ -x .venv/bin/pytest ] || die "'.venv/bin/pytest' is missing: run 'make install' first"
istioctl_version="$(istioctl version --remote=false 2>/dev/null || true)"
case "$istioctl_version" in
    *"${ISTIO_VERSION}"*) ;;
    *) printf '    note: istioctl reports %s; the suite is pinned to Istio %s\n' "${istioctl_version:-?}" "$ISTIO_VERSION" ;;
esac

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

step "Installing the Gateway API CRDs ${GATEWAY_API_VERSION} (standard channel)"
run kubectl apply --server-side -f "https://github.com/kubernetes-sigs/gateway-api/releases/download/${GATEWAY_API_VERSION}/standard-install.yaml"

step "Installing infergate (charts/infergate: CRDs + operator)"
run helm install infergate charts/infergate \
    --namespace infergate-system --create-namespace \
    --set operator.image.repository="${OPERATOR_IMAGE%:*}" --set operator.image.tag="$TAG" \
    --set epp.image.repository="${EPP_IMAGE%:*}" --set epp.image.tag="$TAG" \
    --wait --timeout 5m

step "Installing Istio ${ISTIO_VERSION} with the Gateway API Inference Extension enabled"
run istioctl install -y --set profile=minimal \
    --set values.pilot.env.SUPPORT_GATEWAY_API_INFERENCE_EXTENSION=true \
    --set values.pilot.env.ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true
run kubectl wait --for=condition=Established crd/gateways.gateway.networking.k8s.io --timeout=60s
run kubectl -n istio-system rollout status deploy/istiod --timeout=5m

step "Running the conformance suite (cluster driver)"
mkdir -p "$REPORT_DIR"
REPORT="${REPORT_DIR}/istio-${ISTIO_VERSION}-default-gateway-report.yaml"
# shellcheck disable=SC2086 # PYTEST_ARGS is word-split on purpose
run .venv/bin/pytest conformance -m conformance -p no:cacheprovider \
    --conformance-driver=cluster --gateway-class=istio \
    --conformance-report="$REPORT" ${PYTEST_ARGS:-}
if [ -f "$REPORT" ]; then
    step "Report written to ${REPORT}"
else
    step "No report written (no conformance test ran)"
fi
