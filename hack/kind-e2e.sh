#!/usr/bin/env bash
# End-to-end check of ferry in a kind cluster without kube-proxy.
#
# Needs Docker (for kind's nodes), kind and kubectl; the image itself is built without
# Docker by `cargo xtask image`. Not run by CI (no Docker engine there): CI runs the same
# behaviours against network namespaces and a fake API server (`cargo xtask test`), and
# the image under containerd (tests/tests/container.rs).
#
#   hack/kind-e2e.sh            # create cluster, deploy ferry, check Services, delete cluster
#   KEEP=1 hack/kind-e2e.sh     # keep the cluster afterwards
#   E2E_FOCUS='\[sig-network\] Services' hack/kind-e2e.sh   # also run upstream e2e tests (needs e2e.test and ginkgo on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-ferry-e2e}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
ARCHIVE=target/image/ferry-$VERSION.oci.tar

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "kind-e2e: $tool is required" >&2; exit 2; }
done

cleanup() {
  [ -n "${KEEP:-}" ] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  [ -z "${KUBECONFIG_FILE:-}" ] || rm -f "$KUBECONFIG_FILE"
}
trap cleanup EXIT

cat <<YAML | kind create cluster --name "$CLUSTER" --config=-
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  kubeProxyMode: none
nodes:
- role: control-plane
- role: worker
- role: worker
YAML

# The OCI archive names itself ghcr.io/ferry-proj/ferry:$VERSION, the image deploy/ferry.yaml uses.
cargo xtask image
kind load image-archive "$ARCHIVE" --name "$CLUSTER"
KUBECONFIG_FILE=$(mktemp)
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG_FILE"
export KUBECONFIG=$KUBECONFIG_FILE

# The API server as the nodes reach it, never through a ClusterIP (bootstrap).
API_HOST=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$CLUSTER-control-plane")
sed -e "s/API_SERVER_HOST/$API_HOST/" -e "s/API_SERVER_PORT/6443/" deploy/ferry.yaml | kubectl apply -f -
kubectl -n kube-system rollout status ds/ferry --timeout=180s

# CoreDNS depends on the kubernetes ClusterIP: it only becomes ready through ferry.
kubectl -n kube-system rollout status deploy/coredns --timeout=180s

kubectl create deployment web --image=registry.k8s.io/e2e-test-images/agnhost:2.53 --replicas=3 -- /agnhost serve-hostname --port 8080
kubectl expose deployment web --port 80 --target-port 8080
kubectl rollout status deploy/web --timeout=120s
kubectl run client --image=registry.k8s.io/e2e-test-images/agnhost:2.53 --restart=Never --command -- sleep 3600
kubectl wait pod/client --for=condition=Ready --timeout=120s

echo "ClusterIP by name (DNS through ferry, then HTTP through ferry):"
seen=$(for i in $(seq 1 30); do kubectl exec client -- /agnhost connect --timeout=3s --protocol=tcp web.default.svc.cluster.local:80 >/dev/null 2>&1 && \
  kubectl exec client -- sh -c 'wget -qO- -T 3 http://web.default.svc.cluster.local/' ; echo; done | sort | uniq -c)
echo "$seen"
[ "$(echo "$seen" | grep -c web-)" -ge 2 ] || { echo "kind-e2e: requests did not spread over the pods" >&2; exit 1; }

echo "Service without endpoints is refused:"
kubectl create service clusterip empty --tcp=80:8080
out=$(kubectl exec client -- /agnhost connect --timeout=3s --protocol=tcp empty.default.svc.cluster.local:80 2>&1 || true)
echo "$out"
echo "$out" | grep -q REFUSED || { echo "kind-e2e: expected REFUSED" >&2; exit 1; }

if [ -n "${E2E_FOCUS:-}" ]; then
  command -v e2e.test >/dev/null && command -v ginkgo >/dev/null || { echo "kind-e2e: e2e.test and ginkgo are needed for E2E_FOCUS" >&2; exit 2; }
  ginkgo --focus="$E2E_FOCUS" --skip='\[Serial\]|\[Disruptive\]|\[Feature:' e2e.test -- --kubeconfig="$KUBECONFIG_FILE" --provider=skeleton
fi
echo "kind-e2e: ok"
